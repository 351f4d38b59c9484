"""Compact weights: bfloat16, and int8 with one float32 scale per group of 32 inputs.

Only the matrices are compacted (the blocks' four and the tied wte); biases,
layernorm parameters and wpe stay float32, as do activations and the cache.
A matrix is grouped along its input dimension: axis -2 of the blocks' [in, out]
matrices, axis -1 of wte, which the head reads as [out, in].
"""

from __future__ import annotations

import numpy as np

DTYPES = ("float32", "bfloat16", "int8")
STORAGE = {"float32": np.float32, "bfloat16": np.uint16, "int8": np.int8}  # bfloat16 as its bits
MATRICES = ("wte", "c_attn_w", "attn_c_proj_w", "c_fc_w", "mlp_c_proj_w")
GROUP = 32  # inputs per int8 scale; divides every GPT-2 width (768, 1024, 1280, 1600 and 4x those)


def input_axis(field: str) -> int:
    return -1 if field == "wte" else -2


def scale_shape(field: str, shape: tuple) -> tuple:
    """Shape of the int8 scales of a matrix of ``shape`` (any leading axes)."""
    axis = len(shape) + input_axis(field)
    return shape[:axis] + (shape[axis] // GROUP,) + shape[axis + 1:]


def to_bfloat16(a: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16), rounding to nearest, ties to even."""
    bits = np.ascontiguousarray(a, np.float32).view(np.uint32)
    return ((bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16).astype(np.uint16)


def from_bfloat16(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bits (uint16) -> float32, exactly (a bfloat16 is float32's top half)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def quantize(field: str, a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 per group of GROUP inputs: a ~= q * scale, q in [-127, 127]."""
    grouped, axis = _grouped(field, a)
    amax = np.abs(grouped).max(axis=axis, keepdims=True)
    scale = np.where(amax > 0, amax / np.float32(127), np.float32(1)).astype(np.float32)
    q = np.clip(np.rint(grouped / scale), -127, 127).astype(np.int8)
    return q.reshape(a.shape), np.squeeze(scale, axis=axis)


def dequantize(field: str, q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    grouped, axis = _grouped(field, q)
    return (grouped * np.expand_dims(scale, axis)).astype(np.float32).reshape(q.shape)


def compress(field: str, a: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray | None]:
    """(stored matrix, int8 scales or None) of float32 ``a`` in ``dtype``."""
    if dtype == "bfloat16":
        return to_bfloat16(a), None
    if dtype == "int8":
        return quantize(field, a)
    return np.ascontiguousarray(a, np.float32), None


def expand(field: str, stored: np.ndarray, scale: np.ndarray | None) -> np.ndarray:
    """float32 values of a stored matrix, whatever its format."""
    if stored.dtype == np.uint16:
        return from_bfloat16(stored)
    if stored.dtype == np.int8:
        return dequantize(field, stored, scale)
    return stored


def _grouped(field, a):
    """``a`` with its input axis split into (groups, GROUP), and the axis of GROUP."""
    axis = a.ndim + input_axis(field)
    shape = a.shape[:axis] + (a.shape[axis] // GROUP, GROUP) + a.shape[axis + 1:]
    return a.reshape(shape), axis + 1

"""Numba kernels for the parts of GPT-2 that are not matrix products.

Private and unchecked: callers in kvcache.py validate shapes, dtypes and ranges.
Arrays are float32 and C-contiguous; C = n_embd, H = n_head, D = head_dim.
Masking is by loop bounds (a query at position pos reads positions 0..pos), so
no -inf ever enters the arithmetic and fastmath stays safe.
"""

import math

import numpy as np
from numba import njit, prange

# LLVM fast-math minus nnan/ninf: reassociation lets reductions vectorise, while
# comparisons with inf or nan keep their meaning.
FASTMATH = {"nsz", "arcp", "contract", "afn", "reassoc"}

_GELU_C = math.sqrt(2.0 / math.pi)


@njit(cache=True, fastmath=FASTMATH)
def _layernorm(x, g, b, eps, out):
    """out[i] = (x[i] - mean) / sqrt(var + eps) * g + b, biased variance.

    x, out: (n, C); g, b: (C,); eps: float.
    """
    n, C = x.shape
    for i in range(n):
        mean = 0.0
        for j in range(C):
            mean += x[i, j]
        mean /= C
        var = 0.0
        for j in range(C):
            d = x[i, j] - mean
            var += d * d
        var /= C
        rstd = 1.0 / math.sqrt(var + eps)
        for j in range(C):
            out[i, j] = (x[i, j] - mean) * rstd * g[j] + b[j]


@njit(cache=True, fastmath=FASTMATH)
def _bias_gelu(x, b):
    """In place: x = gelu(x + b), GPT-2's tanh approximation.

    x: (n, F); b: (F,).
    """
    n, F = x.shape
    for i in range(n):
        for j in range(F):
            y = x[i, j] + b[j]
            x[i, j] = 0.5 * y * (1.0 + math.tanh(_GELU_C * (y + 0.044715 * y * y * y)))


@njit(cache=True)
def _write_kv(qkv, k, v, lengths, layer, start):
    """Copy the keys and values of T new positions into one layer of the cache.

    qkv: (T, 3C) rows [q | k | v]; k, v: (n_layer, H, max_len, D);
    lengths: (n_layer,) int64, set to start + T for this layer only.
    """
    T = qkv.shape[0]
    H, D = k.shape[1], k.shape[3]
    C = H * D
    for i in range(T):
        for h in range(H):
            for d in range(D):
                k[layer, h, start + i, d] = qkv[i, C + h * D + d]
                v[layer, h, start + i, d] = qkv[i, 2 * C + h * D + d]
    lengths[layer] = start + T


@njit(cache=True, parallel=True, fastmath=FASTMATH)
def _attend(qkv, k, v, layer, start, out):
    """Causal attention of T queries at positions start..start+T-1 over the cache.

    qkv: (T, 3C), queries in columns [0, C); k, v: (n_layer, H, max_len, D), rows
    0..start+T-1 of ``layer`` already written; out: (T, C), heads side by side.
    Parallel over heads.
    """
    T = qkv.shape[0]
    H, D = k.shape[1], k.shape[3]
    scale = np.float32(1.0 / math.sqrt(D))
    for h in prange(H):
        scores = np.empty(start + T, np.float32)  # (pos + 1,) used per query
        acc = np.empty(D, np.float32)
        for i in range(T):
            pos = start + i
            q = qkv[i, h * D:(h + 1) * D]
            peak = -np.inf
            for t in range(pos + 1):
                s = np.float32(0.0)
                for d in range(D):
                    s += q[d] * k[layer, h, t, d]
                s *= scale
                scores[t] = s
                peak = max(peak, s)
            total = np.float32(0.0)
            for t in range(pos + 1):
                e = np.float32(math.exp(scores[t] - peak))
                scores[t] = e
                total += e
            acc[:] = 0.0
            for t in range(pos + 1):
                p = scores[t]
                for d in range(D):
                    acc[d] += p * v[layer, h, t, d]
            for d in range(D):
                out[i, h * D + d] = acc[d] / total

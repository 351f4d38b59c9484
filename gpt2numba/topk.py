"""@njit kernels of a beam search step: the rows' log-softmax, and the k best scores over many rows.

One pass each over (beams, vocab): NumPy's float64 conversion, exp and log, then argpartition over
beams x vocab took 6 ms a step for 4 beams of GPT-2's vocabulary; these take well under 1 ms
(docs/performance.md). No validation here: beams.py checks and calls.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit


@njit("void(float32[:, ::1], float64[:, ::1])", cache=True, nogil=True)
def _log_softmax(z, out):
    """out[b] = log softmax(z[b]) in float64.  z, out: (rows, vocab)."""
    rows, vocab = z.shape
    for b in range(rows):
        top = -math.inf
        for t in range(vocab):
            top = max(top, np.float64(z[b, t]))
        total = 0.0
        for t in range(vocab):
            total += math.exp(z[b, t] - top)
        shift = top + math.log(total)
        for t in range(vocab):
            out[b, t] = z[b, t] - shift


@njit("Tuple((float64[::1], int64[::1]))(float64[:, ::1], float64[::1], int64)", cache=True, nogil=True)
def _best(x, offsets, k):
    """The k largest of x[b, t] + offsets[b], largest first, equal ones by flat index b * vocab + t (the lower
    first): (values (k,), flat indices (k,)).  x: (rows, vocab), offsets: (rows,); k <= rows * vocab."""
    rows, vocab = x.shape
    values = np.full(k, -math.inf)
    index = np.full(k, -1, np.int64)
    filled = 0
    for b in range(rows):
        for t in range(vocab):
            v = x[b, t] + offsets[b]
            if filled == k and not v > values[k - 1]:
                continue
            at = min(filled, k - 1)
            while at > 0 and values[at - 1] < v:  # (an equal value stays ahead: it came first)
                values[at] = values[at - 1]
                index[at] = index[at - 1]
                at -= 1
            values[at] = v
            index[at] = b * vocab + t
            filled = min(filled + 1, k)
    return values, index

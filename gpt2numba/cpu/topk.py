"""@njit kernels of a beam search step: the rows' log-softmax, and the k best scores over many rows.

One pass each over (beams, vocab), the exponentials vectorised (kernels._exp_inplace): a step of 4 beams
of GPT-2's vocabulary costs under a millisecond (docs/performance-history.md, "Beam search"). No validation
here: beams.py checks.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from . import numbacache
from .kernels import FASTMATH, _exp_inplace


@njit(cache=True, nogil=True, fastmath=FASTMATH)
def _log_softmax(z, out):
    """out[b] = log softmax(z[b]) in float64, the sum of exponentials in float64 over kernels._exp_inplace's
    float32 exponentials (vectorised; relative error under 1e-7).  z: float32 (rows, vocab), out: float64."""
    rows, vocab = z.shape
    e = np.empty(vocab, np.float32)
    bits = np.empty(vocab, np.int32)
    for b in range(rows):
        top = z[b].max()
        for t in range(vocab):
            e[t] = z[b, t] - top
        _exp_inplace(e, bits)
        total = 0.0
        for t in range(vocab):
            total += e[t]
        shift = np.float64(top) + math.log(total)
        for t in range(vocab):
            out[b, t] = z[b, t] - shift


@njit("Tuple((float64[::1], int64[::1]))(float64[:, ::1], float64[::1], int64)", cache=True, nogil=True, fastmath=False)
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


numbacache.guard(__name__)  # this module's cached kernels load and save under a lock (numbacache.py)

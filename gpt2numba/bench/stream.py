"""The benchmark's read-rate probe: a sum that streams an array once, one contiguous block per thread."""

from numba import njit, prange

from ..cpu import numbacache


@njit(cache=True, nogil=True, parallel=True, fastmath=True)
def stream_sum(a):
    """Sum of a 1-D float32 array: every byte read once, in order, on the threads set."""
    total = 0.0
    for i in prange(a.size):
        total += a[i]
    return total


numbacache.guard(__name__)  # this module's cached kernels load and save under a lock (numbacache.py)

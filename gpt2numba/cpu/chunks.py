"""Work sharing inside a parallel region: chunks claimed from an atomic counter.

The words every parallel kernel uses:
- chunk: a piece of a kernel's work. A kernel cuts its work into n_chunks of them: as many
  as the forward pass gives it (dispatch.n_chunks), or a count of its own unit (a row, a run
  of attention tiles, inttiles.CHUNK outputs).
- span: the [start, end) of chunk c of n_chunks over a total (_span): equal steps of
  ceil(total / n_chunks), rounded up to a multiple of ``align`` (whole cache lines, four
  vocabulary rows); the last spans may be shorter, or empty.
- claim: taking the next chunk nobody has taken, by an atomic increment of a counter that the
  whole region shares (_claim; _claimed yields them until none is left).
- threads: Numba's threads run the prange's iterations; a kernel starts one iteration per
  chunk (fewer where each needs buffers of its own), and each claims chunks until none is left.

Every parallel kernel has this shape:

    nxt = np.zeros(1, np.int64)  # the next chunk
    for _ in prange(n_chunks):
        for c in _claimed(nxt, n_chunks):
            start, end = _span(c, n_chunks, total, align)
            ...                  # chunk c's work

Numba splits a prange statically, an equal share of iterations per thread, and the region
waits for the slowest. On a machine where another process takes a core away, the slowest is
the thread that lost its core. With chunks claimed as threads are free, a thread that runs
takes over the work of one that does not (as llama.cpp's matrix products do), and the
iterations of a thread that comes late find nothing left. Which thread does a chunk never
changes what the chunk computes, so results do not depend on the scheduling.
"""

from numba import njit, types
from numba.extending import intrinsic

from . import numbacache


@intrinsic
def _claim(typingctx, counter):
    """The next chunk: counter[0] before an atomic increment. counter: int64 (1,), C-contiguous."""
    if not (isinstance(counter, types.Array) and counter.dtype == types.int64 and counter.ndim == 1):
        return None

    def codegen(context, builder, sig, args):
        array = context.make_array(sig.args[0])(context, builder, args[0])
        one = context.get_constant(types.int64, 1)
        return builder.atomic_rmw("add", array.data, one, "monotonic")

    return types.int64(counter), codegen


# Not cache=True: Numba cannot compile a kernel against a generator it loaded from its cache (a KeyError
# in get_generator_impl), and a kernel is compiled anew whenever its own module changes.
@njit(nogil=True, fastmath=False)
def _claimed(counter, n_chunks):
    """The chunks this iteration claims from ``counter`` (int64 (1,), zero when the region starts), one
    at a time, until all n_chunks are taken."""
    c = _claim(counter)
    while c < n_chunks:
        yield c
        c = _claim(counter)


@njit(nogil=True, inline="always", fastmath=False)
def _span(c, n_chunks, total, align):
    """(start, end) of chunk c of n_chunks over range(total): steps of ceil(total / n_chunks) rounded up to
    a multiple of align, clipped to total."""
    step = ((total + n_chunks - 1) // n_chunks + align - 1) // align * align
    start = min(total, c * step)
    return start, min(total, start + step)


numbacache.guard(__name__)  # this module's cached kernels load and save under a lock (numbacache.py)

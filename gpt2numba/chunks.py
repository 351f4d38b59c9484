"""Work sharing inside a parallel region: chunks handed out from an atomic counter.

A parallel kernel's prange runs one iteration per chunk, but an iteration does not do
its own chunk: it takes the next unclaimed one, and keeps taking until none is left:

    nxt = np.zeros(1, np.int64)
    for _ in prange(n_chunks):
        c = _claim(nxt)
        while c < n_chunks:
            ...              # chunk c's work
            c = _claim(nxt)

Numba splits a prange statically, an equal share per thread, and the region waits for
the slowest. On a machine where another process takes a core away, the slowest is the
thread that lost its core, and every region waits for the OS to give it back. With
chunks claimed as threads are free, a thread that runs takes over the work of one that
does not (as llama.cpp's matrix products do), and the iterations of a thread that comes
late find nothing left. Which thread does a chunk never changes what the chunk computes,
so results do not depend on the scheduling.
"""

from numba import types
from numba.extending import intrinsic


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

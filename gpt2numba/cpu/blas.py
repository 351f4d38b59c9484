"""The float32 matrix product the kernels hand to BLAS: NumPy's own OpenBLAS where NumPy has one.

Numba's np.dot calls the BLAS that SciPy bundles; NumPy's wheels bundle another OpenBLAS,
which can be faster on the few rows of a batch step: on an AMD EPYC (Zen 3), SciPy 1.17.1's
(OpenBLAS 0.3.30) took 1.4x the time of NumPy 2.4's (0.3.31) for 32 rows by GPT-2's
768 x 3072 on one thread, 1.13x for 128 rows, 1.04x for 512. So _gemm calls, through
the symbols SGEMM and SGEMV, NumPy's cblas_sgemm and cblas_sgemv (64-bit integers) when
they can be found, and otherwise _fallback_gemm and _fallback_gemv, C-callable shims over
Numba's np.dot. The symbols are resolved when a compiled kernel is loaded, so the kernels'
on-disk cache stays valid either way. One row goes to sgemv: sgemm multiplies it as a
matrix (a float32 decode step took 1.2-1.6x the time).

Its callers: _linear (float32, and bfloat16 widened), the heads, and attention over a
compact cache or over tiles of queries.

Private and unchecked, as the kernels: callers pass float32 arrays whose rows are contiguous.

one_thread() limits every BLAS library to one thread while passes run (our threads are the parallelism), from
whichever thread a pass runs on.
"""

import ctypes
import functools
import itertools

import llvmlite.binding as ll
import numpy as np
from llvmlite import ir
from numba import carray, cfunc, njit, types
from numba.extending import intrinsic

from . import numbacache

SGEMM, SGEMV = "gpt2numba_cblas_sgemm", "gpt2numba_cblas_sgemv"
_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112  # CBLAS's enums
_f32p = types.CPointer(types.float32)

# cblas_sgemm with 64-bit integers (OpenBLAS's ILP64 build): order, trans_a, trans_b, M, N, K, alpha, A, lda,
# B, ldb, beta, C, ldc
_GEMM = types.void(types.int32, types.int32, types.int32, types.int64, types.int64, types.int64,
                   types.float32, _f32p, types.int64, _f32p, types.int64, types.float32, _f32p, types.int64)
# cblas_sgemv: order, trans, M, N, alpha, A, lda, X, incX, beta, Y, incY
_GEMV = types.void(types.int32, types.int32, types.int64, types.int64, types.float32, _f32p, types.int64,
                   _f32p, types.int64, types.float32, _f32p, types.int64)


@cfunc(_GEMM, cache=True)
def _fallback_gemm(order, trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc):
    """cblas_sgemm for what _gemm asks (row-major, A not transposed, alpha 1, beta 0), by Numba's np.dot."""
    a = carray(A, (M, lda))[:, :K].copy()
    if trans_b == _TRANS:
        b = carray(B, (N, ldb))[:, :K].T.copy()
    else:
        b = carray(B, (K, ldb))[:, :N].copy()
    c = carray(C, (M, ldc))
    c[:, :N] = np.dot(a, b)


@cfunc(_GEMV, cache=True)
def _fallback_gemv(order, trans, M, N, alpha, A, lda, X, incx, beta, Y, incy):
    """cblas_sgemv for what _gemm asks (row-major, alpha 1, beta 0, unit increments), by Numba's np.dot."""
    a = carray(A, (M, lda))[:, :N].copy()
    if trans == _TRANS:
        carray(Y, N)[:] = np.dot(carray(X, M), a)
    else:
        carray(Y, M)[:] = np.dot(a, carray(X, N))


def one_thread():
    """Every BLAS library loaded limited to one thread; returns a function that puts each count back as found.

    A pthreads OpenBLAS (NumPy's and SciPy's wheels) keeps one count for the process, which threadpoolctl
    3.8 lets only the first Python thread that set it change: another thread's limit is ignored without a
    word, so a pass run from a second thread (the server's engine, a thread pool) called BLAS with all its
    threads, beside ours and with other bits. Those counts are set here through OpenBLAS's own functions;
    every other library (MKL, BLIS, an OpenMP OpenBLAS) through threadpoolctl, whose limits hold from any
    thread for them.
    """
    counts, others = _thread_counts()
    before = [get() for get, _ in counts]
    for _, put in counts:
        put(1)
    limiter = others.limit(limits=1) if others is not None else None

    def restore():
        for (_, put), n in zip(counts, before):
            put(n)
        if limiter is not None:
            limiter.restore_original_limits()
    return restore


@functools.lru_cache(maxsize=1)
def _thread_counts():
    """([(get, set) of each pthreads OpenBLAS's thread count], threadpoolctl's controller of the other BLAS
    libraries or None), with SciPy's BLAS, which Numba's np.dot calls, loaded first."""
    import scipy.linalg.cython_blas  # noqa: F401
    from threadpoolctl import ThreadpoolController

    blas = ThreadpoolController().select(user_api="blas")
    counts, others = [], []
    for info in blas.info():
        pair = _openblas_count(info) if info.get("threading_layer") == "pthreads" else None
        if pair is None:
            others.append(info["filepath"])
        else:
            counts.append(pair)
    return counts, blas.select(filepath=others) if others else None


def _openblas_count(info: dict):
    """(get, set) of an OpenBLAS's process-wide thread count, or None where its functions are not found."""
    if info.get("internal_api") != "openblas":
        return None
    try:
        handle = ctypes.CDLL(info["filepath"])
    except OSError:
        return None
    for prefix, suffix in itertools.product(("", "scipy_"), ("", "64_", "_64")):
        names = [f"{prefix}openblas_{verb}_num_threads{suffix}" for verb in ("get", "set")]
        if all(hasattr(handle, name) for name in names):
            get, put = (getattr(handle, name) for name in names)
            get.restype, put.argtypes = ctypes.c_int, [ctypes.c_int]
            return get, put
    return None


def _numpy_blas():
    """The addresses of cblas_sgemm and cblas_sgemv in NumPy's bundled OpenBLAS (64-bit integers), or None."""
    from threadpoolctl import threadpool_info

    for lib in threadpool_info():
        if lib.get("internal_api") != "openblas" or "numpy" not in lib.get("filepath", ""):
            continue
        try:
            handle = ctypes.CDLL(lib["filepath"])
        except OSError:
            continue
        for prefix, suffix in (("scipy_", "64_"), ("", "64_")):  # NumPy >= 2's wheels, then older ILP64 ones
            names = [f"{prefix}cblas_{name}{suffix}" for name in ("sgemm", "sgemv")]
            if all(hasattr(handle, name) for name in names):
                return tuple(ctypes.cast(getattr(handle, name), ctypes.c_void_p).value for name in names)
    return None


_NUMPY = _numpy_blas()
NUMPY_BLAS = _NUMPY is not None  # whether _gemm goes to NumPy's OpenBLAS
ll.add_symbol(SGEMM, _NUMPY[0] if _NUMPY else _fallback_gemm.address)
ll.add_symbol(SGEMV, _NUMPY[1] if _NUMPY else _fallback_gemv.address)


def _call(builder, symbol, signature, args):
    """A call of the C function at ``symbol`` (types as ``signature``, a Numba signature of ints, floats and
    float pointers), with these LLVM values: integers cast to the width, addresses (intp) to pointers."""
    f32 = ir.FloatType()
    params = [f32.as_pointer() if isinstance(t, types.CPointer) else f32 if t == types.float32
              else ir.IntType(t.bitwidth) for t in signature.args]
    fn = builder.module.globals.get(symbol) or ir.Function(builder.module, ir.FunctionType(ir.VoidType(), params),
                                                           symbol)
    cast = []
    for ty, v in zip(params, args):
        if isinstance(ty, ir.PointerType):
            v = builder.inttoptr(v, ty)
        elif isinstance(ty, ir.IntType) and v.type.width > ty.width:
            v = builder.trunc(v, ty)
        cast.append(v)
    builder.call(fn, cast)


@intrinsic
def _cblas_sgemm(typingctx, trans_b, M, N, K, a, lda, b, ldb, c, ldc):
    """C[:M, :N] = A @ op(B), row-major, by the function at SGEMM; a, b, c: data addresses (intp)."""
    def codegen(context, builder, sig, args):
        tb, m, n, k, av, la, bv, lb, cv, lc = args
        one, zero, i64 = ir.Constant(ir.FloatType(), 1.0), ir.Constant(ir.FloatType(), 0.0), ir.IntType(64)
        _call(builder, SGEMM, _GEMM, [ir.Constant(i64, _ROW_MAJOR), ir.Constant(i64, _NO_TRANS), tb, m, n, k,
                                      one, av, la, bv, lb, zero, cv, lc])
        return context.get_dummy_value()

    return types.void(types.int64, types.int64, types.int64, types.int64, types.intp, types.int64, types.intp,
                      types.int64, types.intp, types.int64), codegen


@intrinsic
def _cblas_sgemv(typingctx, trans, M, N, a, lda, x, y):
    """y = op(A) @ x, A (M, N) row-major, x and y contiguous, by the function at SGEMV; a, x, y: addresses."""
    def codegen(context, builder, sig, args):
        tr, m, n, av, la, xv, yv = args
        one, zero, i64 = ir.Constant(ir.FloatType(), 1.0), ir.Constant(ir.FloatType(), 0.0), ir.IntType(64)
        unit = ir.Constant(i64, 1)
        _call(builder, SGEMV, _GEMV, [ir.Constant(i64, _ROW_MAJOR), tr, m, n, one, av, la, xv, unit, zero, yv, unit])
        return context.get_dummy_value()

    return types.void(types.int64, types.int64, types.int64, types.intp, types.int64, types.intp, types.intp), codegen


@njit(cache=True, nogil=True, fastmath=False)
def _gemm(a, b, out, b_transposed):
    """out = a @ b, or a @ b.T when ``b_transposed``: float32 2-D arrays whose rows are contiguous
    (slices of rows and of columns are fine); out (M, N) with a (M, K) and b (K, N), or (N, K).
    One row is a matrix-vector product."""
    M, K = a.shape
    N = out.shape[1]
    if M == 0 or N == 0:
        return
    if K == 0:
        out[:] = 0.0
        return
    if M == 1:
        if b_transposed:  # out = b @ a[0]
            _cblas_sgemv(_NO_TRANS, N, K, b.ctypes.data, _leading(b), a.ctypes.data, out.ctypes.data)
        else:  # out = b.T @ a[0]
            _cblas_sgemv(_TRANS, K, N, b.ctypes.data, _leading(b), a.ctypes.data, out.ctypes.data)
        return
    _cblas_sgemm(_TRANS if b_transposed else _NO_TRANS, M, N, K, a.ctypes.data, _leading(a),
                 b.ctypes.data, _leading(b), out.ctypes.data, _leading(out))


@njit(cache=True, nogil=True, inline="always", fastmath=False)
def _leading(m):
    """The leading dimension BLAS takes for a 2-D float32 array with contiguous rows: its row stride in elements;
    for a single row, whose stride NumPy may set to anything (BLAS refuses less than a row), the row's length."""
    return m.strides[0] // 4 if m.shape[0] > 1 else m.shape[1]


numbacache.guard(__name__)  # this module's cached kernels load and save under a lock (numbacache.py)

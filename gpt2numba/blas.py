"""The float32 matrix product the kernels hand to BLAS: NumPy's own OpenBLAS where NumPy has one.

Numba's np.dot calls the BLAS that SciPy bundles; NumPy's wheels bundle another OpenBLAS,
which can be faster on the few rows of a batch step: on an AMD EPYC (Zen 3), SciPy 1.17.1's
(OpenBLAS 0.3.30) took 1.4x the time of NumPy 2.4's (0.3.31) for 32 rows by GPT-2's
768 x 3072 on one thread, 1.13x for 128 rows, 1.04x for 512. So _gemm calls, through
the symbol SYMBOL, NumPy's cblas_sgemm (64-bit integers) when it can be found, and
otherwise _fallback, a C-callable shim over Numba's np.dot. The symbol is resolved when a
compiled kernel is loaded, so the kernels' on-disk cache stays valid either way.

Its callers: _linear (float32, and bfloat16 widened), the heads' BLAS chunks and attention's
tiles of queries. One row is not for _gemm: NumPy's OpenBLAS multiplies it as a matrix (a float32 decode step
took 1.2-1.6x the time), where Numba's np.dot reaches a matrix-vector product.

Private and unchecked, as the kernels: callers pass float32 arrays whose rows are contiguous.
"""

import ctypes

import llvmlite.binding as ll
import numpy as np
from llvmlite import ir
from numba import carray, cfunc, njit, types
from numba.extending import intrinsic

SYMBOL = "gpt2numba_cblas_sgemm"
_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112  # CBLAS's enums

# cblas_sgemm with 64-bit integers (OpenBLAS's ILP64 build): order, trans_a, trans_b, M, N, K, alpha, A, lda,
# B, ldb, beta, C, ldc
_SIGNATURE = types.void(types.int32, types.int32, types.int32, types.int64, types.int64, types.int64,
                        types.float32, types.CPointer(types.float32), types.int64,
                        types.CPointer(types.float32), types.int64, types.float32,
                        types.CPointer(types.float32), types.int64)


@cfunc(_SIGNATURE, cache=True)
def _fallback(order, trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc):
    """cblas_sgemm for what _gemm asks (row-major, A not transposed, alpha 1, beta 0), by Numba's np.dot."""
    a = carray(A, (M, lda))[:, :K].copy()
    if trans_b == _TRANS:
        b = carray(B, (N, ldb))[:, :K].T.copy()
    else:
        b = carray(B, (K, ldb))[:, :N].copy()
    c = carray(C, (M, ldc))
    c[:, :N] = np.dot(a, b)


def _numpy_sgemm():
    """The address of cblas_sgemm in NumPy's bundled OpenBLAS (64-bit integers), or None."""
    from threadpoolctl import threadpool_info

    for lib in threadpool_info():
        if lib.get("internal_api") != "openblas" or "numpy" not in lib.get("filepath", ""):
            continue
        try:
            handle = ctypes.CDLL(lib["filepath"])
        except OSError:
            continue
        for name in ("scipy_cblas_sgemm64_", "cblas_sgemm64_"):  # NumPy >= 2's wheels, then older ILP64 ones
            if hasattr(handle, name):
                return ctypes.cast(getattr(handle, name), ctypes.c_void_p).value
    return None


_NUMPY_SGEMM = _numpy_sgemm()
NUMPY_BLAS = _NUMPY_SGEMM is not None  # whether _gemm goes to NumPy's OpenBLAS
ll.add_symbol(SYMBOL, _NUMPY_SGEMM or _fallback.address)


@intrinsic
def _cblas_sgemm(typingctx, trans_b, M, N, K, a, lda, b, ldb, c, ldc):
    """C[:M, :N] = A @ op(B), row-major, by the function at SYMBOL; a, b, c: data addresses (intp)."""
    def codegen(context, builder, sig, args):
        i32, i64, f32 = ir.IntType(32), ir.IntType(64), ir.FloatType()
        ptr = f32.as_pointer()
        fnty = ir.FunctionType(ir.VoidType(), [i32, i32, i32, i64, i64, i64, f32, ptr, i64, ptr, i64, f32, ptr, i64])
        fn = builder.module.globals.get(SYMBOL) or ir.Function(builder.module, fnty, SYMBOL)
        tb, m, n, k, av, la, bv, lb, cv, lc = args
        builder.call(fn, [ir.Constant(i32, _ROW_MAJOR), ir.Constant(i32, _NO_TRANS),
                          builder.trunc(tb, i32), m, n, k, ir.Constant(f32, 1.0), builder.inttoptr(av, ptr), la,
                          builder.inttoptr(bv, ptr), lb, ir.Constant(f32, 0.0), builder.inttoptr(cv, ptr), lc])
        return context.get_dummy_value()

    return types.void(types.int64, types.int64, types.int64, types.int64, types.intp, types.int64, types.intp,
                      types.int64, types.intp, types.int64), codegen


@njit(cache=True, nogil=True)
def _gemm(a, b, out, b_transposed):
    """out = a @ b, or a @ b.T when ``b_transposed``: float32 2-D arrays whose rows are contiguous
    (slices of rows and of columns are fine); out (M, N) with a (M, K) and b (K, N), or (N, K)."""
    M, K = a.shape
    N = out.shape[1]
    if M == 0 or N == 0:
        return
    if K == 0:
        out[:] = 0.0
        return
    _cblas_sgemm(_TRANS if b_transposed else _NO_TRANS, M, N, K, a.ctypes.data, a.strides[0] // 4,
                 b.ctypes.data, b.strides[0] // 4, out.ctypes.data, out.strides[0] // 4)

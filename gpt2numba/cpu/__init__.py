"""The machine: which instruction and from how many rows, which thread, and every @njit kernel.

Start at dispatch.py (the CPU probed once; every kernel choice and row threshold). Kernels: kernels.py
(layernorm, GELU, the cache fill), attention.py (causal attention over the cache),
matkernels.py (float32 and bfloat16 products, the head),
rowtiles.py (a few rows with a matrix [out, in], in tiles), intkernels.py and inttiles.py (int8 and int4
products over one row and many), topk.py (a beam step), blas.py (the float32 GEMM). Threads:
threadlayer.py (Numba's layer), pool.py and regions.py (our pinned threads), chunks.py (work shared inside a
region). Nothing here knows GPT-2: arrays and ints in, arrays out.
"""

"""Compile gpt2numba's kernels into Numba's cache: python tests/warm_kernels.py SHARE [SHARES].

The suite's controller runs one process per share before pytest-xdist starts its workers
(conftest.pytest_configure), so that each kernel is compiled once, not once in every worker.
Each share takes every SHARES-th of the weight formats and of the cache formats, and runs
what the tests run on them: prefill and decode over few rows and many, batches, scoring,
sampling. A kernel that no share reaches is compiled by the first test that needs it, as
without this script.
"""

import sys

import numpy as np

import gpt2numba as g

# As conftest.TINY: 2 layers of 64-wide heads, K = 128 (4 groups), with more positions for many rows.
CONFIG = g.GPT2Config(n_layer=2, n_head=2, n_embd=128, n_positions=128, vocab_size=512)
# (weights, cache, activations)
FORMATS = [(dtype, "float32", "float32") for dtype in ("float32", "int8", "bfloat16", "int4")] + [
    ("bfloat16", "float32", "bfloat16")] + [("float32", kv, "float32") for kv in g.KV_DTYPES if kv != "float32"]


def warm(dtype: str, kv_dtype: str, activations: str) -> None:
    w = g.random_weights(CONFIG, seed=0).astype(dtype, activations)
    rng = np.random.default_rng(0)
    for rows in (3, 80):  # few rows, and more than every few-rows kernel takes
        mc = g.ModelCache(CONFIG, dtype=kv_dtype)
        g.prefill(rng.integers(0, CONFIG.vocab_size, rows), w, mc)
        g.decode_step(1, w, mc)
    for n in (3, 40):
        caches = [g.ModelCache(CONFIG, dtype=kv_dtype) for _ in range(n)]
        g.prefill_batch([rng.integers(0, CONFIG.vocab_size, 1 + i % 5) for i in range(n)], w, caches)
        g.decode_batch([1] * n, w, caches)
    g.score_batch([rng.integers(0, CONFIG.vocab_size, k) for k in (2, 30, 100)], w, kv_dtype=kv_dtype)
    list(g.generate([1, 2], w, max_new_tokens=2, top_k=5, top_p=0.9, seed=0, kv_dtype=kv_dtype))


if __name__ == "__main__":
    share, shares = int(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 1
    for weights_format in FORMATS[share::shares]:
        warm(*weights_format)

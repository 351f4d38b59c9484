"""Results do not depend on how the work is scheduled: thread counts, the pool and threading layers.

Every parallel kernel cuts its work into the same chunks whatever the thread count
(dispatch.MIN_CHUNKS) and threads claim them as they are free (chunks.py), so 1 and 2
threads, gpt2numba's pool (pool.py) and every threading layer of Numba's, must give the same bits.
"""

import concurrent.futures
import json
import subprocess
import sys

import numba
import numpy as np
import pytest

import gpt2numba as g
from gpt2numba.cpu import dispatch
from gpt2numba.model import forward

from conftest import TINY

pytestmark = pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="needs 2 Numba threads")

# A prompt past dispatch.SERIAL_ROWS (the chunked elementwise kernels) and past ROWS_MAX
# and INT_ROWS_MAX (the BLAS paths, the integer tiles), one past 256, a ragged batch, and one
# decode step.
_SCRIPT = """
import dataclasses, hashlib, json, sys
import numpy as np
import gpt2numba as g
sys.path.insert(0, 'tests')
from conftest import TINY
out = {}
for dtype in DTYPES:
    w = g.random_weights(TINY, seed=1, dtype=dtype)
    mc = g.ModelCache(TINY)
    rows = [g.prefill(np.arange(1, 60) * 7 % 512, w, mc, logits="all"), g.decode_step(3, w, mc)[None]]
    long = dataclasses.replace(TINY, n_positions=300)
    rows.append(g.prefill(np.arange(300) * 5 % 512, g.random_weights(long, seed=1, dtype=dtype), g.ModelCache(long),
                          logits="all"))
    caches = [g.ModelCache(TINY) for _ in range(3)]
    rows.append(g.prefill_batch([[5], [1, 2, 3], list(range(9, 30))], w, caches))
    rows.append(g.decode_batch([4, 5, 6], w, caches))
    out[dtype] = hashlib.sha256(b"".join(np.ascontiguousarray(r).tobytes() for r in rows)).hexdigest()
json.dump(out, sys.stdout)
"""


def _tbb_wheel() -> bool:
    from importlib import metadata

    try:
        return metadata.distribution("tbb") is not None
    except metadata.PackageNotFoundError:
        return False


# Whether the tbb package is installed: then NUMBA_THREADING_LAYER=tbb must work, in a virtual environment too
# (threadlayer.launch loads the wheel's library, which the loader does not find there by itself)
_TBB_WHEEL = _tbb_wheel()


def _digests(env=None, dtypes=("float32", "bfloat16", "int8", "int4"), timeout=540) -> dict:
    """The script's digests for weights of ``dtypes``, run here (env None) or in a fresh process with ``env``
    added."""
    script = f"DTYPES = {tuple(dtypes)!r}\n{_SCRIPT}"
    if env is None:
        scope = {}
        exec(compile(script.replace("json.dump(out, sys.stdout)", ""), "<threads>", "exec"), scope)
        return scope["out"]
    import os
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **env}, cwd=os.path.dirname(os.path.dirname(__file__)))
    if done.returncode:
        missing = "No threading layer could be loaded" in done.stderr or "is not available" in done.stderr
        if missing and not (env.get("NUMBA_THREADING_LAYER") == "tbb" and _TBB_WHEEL):  # (the wheel's must load)
            pytest.skip(f"threading layer {env} is not available here: {done.stderr.strip().splitlines()[-1]}")
        raise AssertionError(done.stderr)
    return json.loads(done.stdout)


def test_one_and_two_threads_give_the_same_bits():
    before = g.get_threads()
    try:
        g.set_threads(1)
        one = _digests()
        g.set_threads(2)
        two = _digests()
    finally:
        g.set_threads(before)
    assert one == two


@pytest.mark.parametrize("layer", ["omp", "tbb", "workqueue"])
def test_every_threading_layer_gives_the_same_bits(layer):
    """Each of Numba's layers on its own (GPT2NUMBA_POOL=0), in its own process (a process picks its layer
    once), against this one's regions on gpt2numba's pool."""
    assert _digests({"NUMBA_THREADING_LAYER": layer, "NUMBA_NUM_THREADS": "2", "GPT2NUMBA_POOL": "0"}) == _digests()


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_process_on_a_cold_cache_gives_the_bits_of_a_warm_one(tmp_path):
    """A process that compiles its kernels itself (an empty Numba cache) against this one, which loads what the
    suite's warm-up compiled in several processes at once (where Numba's cache once let one signature's index
    entry name another's code: cpu/numbacache.py). float32 and int8: BLAS, the row tiles, the integer kernels
    and tiles, and every kernel the formats share; a cold compile of them takes minutes on 2 busy cores."""
    formats = ("float32", "int8")
    assert _digests({"NUMBA_CACHE_DIR": str(tmp_path)}, formats, timeout=1100) == _digests(dtypes=formats)


def test_more_threads_than_cpus_give_the_same_bits():
    """12 threads (unpinned on a small machine) cut the work in more chunks, so against 12 on Numba's layer."""
    assert _digests({"NUMBA_NUM_THREADS": "12"}) == _digests({"NUMBA_NUM_THREADS": "12", "GPT2NUMBA_POOL": "0"})


def test_chunks_do_not_follow_the_thread_count(monkeypatch):
    """The cut is MIN_CHUNKS for 1 and 2 threads, so that both cut the work alike (the bit-for-bit test
    above compares them)."""
    seen = []
    real = forward._attention_plan

    def spy(row0, pos0, n_head, n_chunks):
        seen.append(n_chunks)
        return real(row0, pos0, n_head, n_chunks)
    monkeypatch.setattr(forward, "_attention_plan", spy)
    w = g.random_weights(TINY, seed=0)
    before = g.get_threads()
    try:
        for n in (1, 2):
            g.set_threads(n)
            g.prefill([1, 2, 3], w, g.ModelCache(TINY))
    finally:
        g.set_threads(before)
    assert seen == [dispatch.MIN_CHUNKS, dispatch.MIN_CHUNKS]


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_python_threads_sharing_weights_each_get_their_own_results(dtype):
    """Several Python threads running passes at once on one set of weights (the server's engine
    beside a caller, say): each result is what the same call gives alone."""
    w = g.random_weights(TINY, seed=3, dtype=dtype)

    def run(prompt):
        mc = g.ModelCache(TINY)
        rows = [g.prefill(prompt, w, mc)]
        for _ in range(3):
            rows.append(g.decode_step(int(rows[-1].argmax()), w, mc))
        return np.stack(rows)

    prompts = [np.arange(n) * 11 % 512 for n in (5, 17, 40, 59)] * 2
    alone = [run(p) for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        together = list(pool.map(run, prompts))
    for a, b in zip(alone, together):
        np.testing.assert_array_equal(a, b)

"""The thread pool that runs Numba's parallel regions (gpt2numba/cpu/pool.py).

That results do not depend on it is tests/test_threads.py's: 1 and 2 threads, the pool and each
of Numba's own layers, Python threads sharing weights. Here: that regions really run on the
pool's threads, and what a runtime must get right besides the bits: thread ids, a region
inside a region, a forked child, and moving a thread that lost its CPU.
"""

import multiprocessing
import os
import subprocess
import sys
import time
import warnings

import numba
import numpy as np
import pytest
from llvmlite import binding as ll
from numba import njit, prange

import gpt2numba as g
from gpt2numba.cpu import pool

from conftest import TINY

pytestmark = [
    pytest.mark.skipif(not pool.enabled(), reason="the pool is off here (GPT2NUMBA_POOL=0, or not x86-64)"),
    pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="needs 2 Numba threads"),
]


def test_regions_run_on_the_pool_threads():
    assert ll.address_of_symbol("numba_parallel_for") == pool._parallel_for.address
    n, _ = pool.size(sorted(os.sched_getaffinity(0)), pool.cpu_quota()[0])
    assert len(pool._threads) == pool._state[pool.NWORK] == n - 1


@njit(parallel=True)
def _ids(n, out):
    for i in prange(n):
        s = 0.0
        for k in range(200_000):  # long enough that the worker joins in
            s += np.sqrt(k + i)
        out[i] = numba.get_thread_id() + (0 if s >= 0 else 1)


def test_a_worker_joins_in_with_its_own_thread_id():
    seen = set()
    out = np.full(8, -1, np.int64)
    for _ in range(50):
        _ids(8, out)
        seen.update(out.tolist())
        if seen >= {0, 1}:
            break
    assert seen >= {0, 1} and seen <= set(range(numba.config.NUMBA_NUM_THREADS))


@njit(parallel=True)
def _sum(a):
    total = 0
    for i in prange(a.size):
        total += a[i]
    return total


def test_reductions_keep_one_slot_per_thread():
    """A prange reduction keeps partial sums per thread id: two threads with one id would lose terms."""
    a = np.arange(2_000_000, dtype=np.int64)
    for _ in range(20):
        assert _sum(a) == a.sum()


_MANY = """
import numpy as np, numba
from numba import njit, prange
from gpt2numba.cpu import pool
import gpt2numba.model.forward  # (its import launches Numba's layer and installs the pool)
assert pool._state[pool.NWORK] == 11, pool._state[pool.NWORK]

@njit(parallel=True)
def who(out):
    for i in prange(out.shape[0]):
        s = 0.0
        for k in range(2_000_000):  # long enough that many threads join in
            s += np.sqrt(k + i)
        out[i, 0] = numba.get_thread_id()
        out[i, 1] = pool._syscall(pool.SYS_GETTID, 0, 0, 0, 0) + (0 if s >= 0 else 1)

tids = {}
out = np.zeros((12, 2), np.int64)
for _ in range(5):
    who(out)
    for i, tid in out.tolist():
        tids.setdefault(i, set()).add(tid)
assert all(len(t) == 1 for t in tids.values()), tids  # one thread to an id
assert len(tids) >= 4 and set(tids) <= set(range(12)), tids
"""


def test_twelve_threads_keep_their_own_ids():
    """Each of 12 threads (more than this machine's CPUs) has its own state: its own thread id."""
    done = subprocess.run([sys.executable, "-c", _MANY], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "NUMBA_NUM_THREADS": "12"})
    assert done.returncode == 0, done.stderr


@njit(parallel=True)
def _outer(a, out):
    for i in prange(a.shape[0]):
        out[i] = _sum(a[i])


def test_a_region_inside_a_region_runs_on_its_caller():
    a = np.arange(8 * 10_000, dtype=np.int64).reshape(8, 10_000)
    out = np.zeros(8, np.int64)
    _outer(a, out)
    np.testing.assert_array_equal(out, a.sum(axis=1))


def _child_logits(queue):
    w = g.random_weights(TINY, seed=2)
    queue.put((g.prefill(np.arange(40) * 3 % 512, w, g.ModelCache(TINY)), len(pool._threads)))


def test_a_forked_child_starts_its_own_threads():
    w = g.random_weights(TINY, seed=2)
    here = g.prefill(np.arange(40) * 3 % 512, w, g.ModelCache(TINY))
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads running
        child = ctx.Process(target=_child_logits, args=(queue,))
        child.start()
    logits, threads = queue.get(timeout=300)
    child.join(timeout=60)
    assert child.exitcode == 0
    np.testing.assert_array_equal(logits, here)
    assert threads == len(pool._threads)


def test_the_caller_is_pinned_for_a_pass_only():
    before = os.sched_getaffinity(0)
    w = g.random_weights(TINY, seed=0)
    g.prefill(np.arange(30), w, g.ModelCache(TINY))
    assert os.sched_getaffinity(0) == before


@pytest.mark.skipif(not pool._cpus, reason="the pool pins its threads only when they cover every CPU")
def _wait_until_asleep(tid, deadline_s=10.0):
    """Until the thread's CPU time stands still over 50 ms (past its spinning, asleep): on a busy machine a
    fixed pause may end while it still spins, and the rescue then rightly leaves a running thread alone."""
    def cpu_ns():
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                return int(f.read().split()[0])
        except FileNotFoundError:  # (a kernel without schedstats: clock ticks)
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return int(fields[11]) + int(fields[12])

    deadline = time.monotonic() + deadline_s
    before = cpu_ns()
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = cpu_ns()
        if now == before:
            return
        before = now


def test_a_thread_that_stops_running_is_moved_to_the_callers_cpu():
    """The rescue, driven by hand: worker 1 asleep (its CPU time still) but marked as holding an entry.
    The caller's second look moves it to the caller's CPU; after its next job it pins itself back."""
    tid = int(pool._state[pool.TIDS + 8])
    with pool.pinned():  # (the threads are pinned at the first pass, if no test ran one before)
        pass
    # a rescue in an earlier test, or during the job below (on a busy machine the caller may find the worker
    # stalled), may have moved it: a job's start puts it back, so run jobs until one ends with it at home
    deadline = time.monotonic() + 10
    while True:
        _ids(8, np.zeros(8, np.int64))
        _wait_until_asleep(tid)
        if os.sched_getaffinity(tid) == {pool._cpus[1]} or time.monotonic() > deadline:
            break
    assert os.sched_getaffinity(tid) == {pool._cpus[1]}
    with pool.pinned():
        pool._state[pool.RUNNING + 8] = 1
        try:
            pool._rescue(2)
            pool._rescue(2)
        finally:
            pool._state[pool.RUNNING + 8] = 0
        assert os.sched_getaffinity(tid) == {pool._cpus[0]}
    assert pool._state[pool.MOVED + 8] == 1
    _ids(8, np.zeros(8, np.int64))  # a job: the worker pins itself back
    deadline = time.monotonic() + 10
    while os.sched_getaffinity(tid) != {pool._cpus[1]} and time.monotonic() < deadline:
        time.sleep(0.01)
    assert os.sched_getaffinity(tid) == {pool._cpus[1]}
    assert pool._state[pool.MOVED + 8] == 0

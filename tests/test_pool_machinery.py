"""The pool (gpt2numba/pool.py) outside the plain case: forked children, Python threads at once.

tests/test_pool.py checks the pool's own runtime (thread ids, nesting, the rescue); here, what a
user's process does around it. Each fork runs in a subprocess of its own, so that no thread of
this test process (pytest-xdist's among them) is in a forked child.
"""

import concurrent.futures
import os
import subprocess
import sys

import numba
import numpy as np
import pytest

import gpt2numba as g
from gpt2numba import pool

from conftest import TINY

pytestmark = [
    pytest.mark.skipif(not pool.enabled(), reason="the pool is off here (GPT2NUMBA_POOL=0, or not x86-64)"),
    pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="needs 2 Numba threads"),
]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(script: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """``script`` in a fresh Python with tests/ importable; fails the test on a non-zero exit."""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT, **(env or {})})
    assert done.returncode == 0, done.stdout + done.stderr
    return done


_FORK = """
import os, subprocess, sys, threading, warnings
import numpy as np
sys.path.insert(0, "tests")
import gpt2numba as g
from gpt2numba import pool
from conftest import TINY

w = g.random_weights(TINY, seed=2)
ids = np.arange(40) * 3 % 512
here = g.prefill(ids, w, g.ModelCache(TINY))
workers = len(pool._threads)
assert workers >= 1, workers
warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads running

# fork without exec: no thread until the child's first region, which starts them; the same logits
pid = os.fork()
if pid == 0:
    ok = threading.active_count() == 1 and not pool._threads
    logits = g.prefill(ids, w, g.ModelCache(TINY))
    ok = ok and len(pool._threads) == workers and np.array_equal(logits, here)
    os._exit(0 if ok else 1)
_, status = os.waitpid(pid, 0)
assert os.waitstatus_to_exitcode(status) == 0, status

# fork and exec: the child between the two runs no region, so it starts no thread
def alone():
    if threading.active_count() != 1 or pool._threads:
        raise RuntimeError("threads started in the child before exec")
done = subprocess.run([sys.executable, "-c", "print('exec')"], preexec_fn=alone, capture_output=True, text=True)
assert done.stdout == "exec\\n", done
print("forks ok")
"""


def test_a_forked_child_starts_its_threads_at_its_first_region_and_a_child_that_execs_never():
    assert "forks ok" in _run(_FORK).stdout

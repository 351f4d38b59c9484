"""The kernels' generic paths: compiled for an x86-64 CPU without AVX (NUMBA_CPU_NAME=generic), in a
subprocess, every format against the float64 oracle.

On such a CPU dispatch.py chooses 128-bit pmaddwd tiles, half floats converted in integer code
(no F16C) and BLAS from 4 rows: paths no AVX2 or AVX-512 machine runs otherwise. The first run
compiles every kernel for that CPU (minutes on 2 busy cores; Numba caches them beside the
host's, so later runs take seconds).
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Each format: a prefill, decode steps and a ragged batch prefill, each row's logits against the oracle's.
_SCRIPT = """
import json, sys
import numpy as np
sys.path.insert(0, "tests")
import gpt2numba as g
from gpt2numba import dispatch, oracle
from conftest import TINY
out = {"features": sorted(dispatch.FEATURES) if dispatch.FEATURES is not None else None,
       "choices": dispatch.CHOICES._asdict()}
rng = np.random.default_rng(0)
for name, dtype, kv in (("float32", "float32", "float32"), ("bfloat16", "bfloat16", "float32"),
                        ("int8", "int8", "float32"), ("int4", "int4", "float32"),
                        ("float16 cache", "float32", "float16")):
    w = g.random_weights(TINY, seed=5, dtype=dtype)
    ids = [int(t) for t in rng.integers(0, TINY.vocab_size, 40)]
    mc = g.ModelCache(TINY, dtype=kv)
    steps = [g.prefill(ids[:36], w, mc)] + [g.decode_step(t, w, mc) for t in ids[36:]]
    caches = [g.ModelCache(TINY, dtype=kv) for _ in range(2)]
    batch = g.prefill_batch([ids[:5], ids[:33]], w, caches)
    refs = oracle.recompute_all_logits(ids, w)
    pairs = [(s, refs[35 + i]) for i, s in enumerate(steps)] + [(batch[0], refs[4]), (batch[1], refs[32])]
    verdicts = [oracle.agreement(s, r, w.dtype) for s, r in pairs]
    out[name] = {"ok": all(ok for ok, _ in verdicts), "why": [why for ok, why in verdicts if not ok],
                 "max_diff": max(float(np.abs(s - r).max()) for s, r in pairs)}
json.dump(out, sys.stdout)
"""


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.skipif(not os.uname().machine == "x86_64", reason="NUMBA_CPU_NAME=generic names an x86-64 CPU here")
def test_every_format_matches_the_oracle_on_a_generic_x86_64_cpu():
    done = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=1100, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": ROOT, "NUMBA_CPU_NAME": "generic",
                               "NUMBA_CPU_FEATURES": ""})
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout)
    assert out["features"] == [], out["features"]  # compiled without AVX, F16C or any other extension
    assert out["choices"]["madd_width"] == 8 and not out["choices"]["f16c"], out["choices"]  # the generic paths
    for name in ("float32", "bfloat16", "int8", "int4", "float16 cache"):
        assert out[name]["ok"], (name, out[name])

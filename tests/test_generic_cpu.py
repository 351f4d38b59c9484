"""The kernels' generic paths: compiled for an x86-64 CPU without AVX (NUMBA_CPU_NAME=generic), in a
subprocess, every format (and bfloat16 activations, widened) against the float64 oracle.

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
from gpt2numba.cpu import dispatch
from gpt2numba.model import oracle
from conftest import TINY
out = {"features": sorted(dispatch.FEATURES) if dispatch.FEATURES is not None else None,
       "choices": dispatch.CHOICES._asdict()}
rng = np.random.default_rng(0)
for name, dtype, kv, act in (("float32", "float32", "float32", "float32"),
                             ("bfloat16", "bfloat16", "float32", "float32"),
                             ("int8", "int8", "float32", "float32"), ("int4", "int4", "float32", "float32"),
                             ("float16 cache", "float32", "float16", "float32"),
                             ("bfloat16 activations", "bfloat16", "float32", "bfloat16")):
    w = g.random_weights(TINY, seed=5).astype(dtype, act)
    ids = [int(t) for t in rng.integers(0, TINY.vocab_size, 40)]
    mc = g.ModelCache(TINY, dtype=kv)
    steps = [g.prefill(ids[:36], w, mc)] + [g.decode_step(t, w, mc) for t in ids[36:]]
    caches = [g.ModelCache(TINY, dtype=kv) for _ in range(2)]
    batch = g.prefill_batch([ids[:5], ids[:33]], w, caches)
    refs = oracle.recompute_all_logits(ids, w)
    pairs = [(s, refs[35 + i]) for i, s in enumerate(steps)] + [(batch[0], refs[4]), (batch[1], refs[32])]
    verdicts = [oracle.agreement(s, r, w) for s, r in pairs]
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
    for name in ("float32", "bfloat16", "int8", "int4", "float16 cache", "bfloat16 activations"):
        assert out[name]["ok"], (name, out[name])


# The pool's cfuncs compile at import on every CPU (the pool itself runs on x86-64 only): another CPU's LLVM
# aborts the process on an x86 instruction, so none may call one where dispatch.X86 is false (their spin's
# pause was the one; the QEMU run of profiling/qemu_aarch64.sh found it). The optimised IR is x86's either
# way, so only the calls of the code's own making are looked for. Numba's cache goes to a directory of the
# subprocess's own, so that what it compiles never reaches the host's.
_NOT_X86 = """
import json, re, sys, types
package = types.ModuleType("gpt2numba")  # the package without its __init__, which would import regions
package.__path__ = ["gpt2numba"]
sys.modules["gpt2numba"] = package
from gpt2numba.cpu import dispatch
dispatch.X86 = False  # as dispatch finds it on aarch64, before regions compiles its cfuncs
from gpt2numba.cpu import regions
from numba.core.ccallback import CFunc
cfuncs = {name: f for name, f in vars(regions).items() if isinstance(f, CFunc)}
json.dump({name: re.findall(r"call void @llvm\\.x86\\.[a-z0-9.]+", f.inspect_llvm()) for name, f in cfuncs.items()},
          sys.stdout)
"""


def test_the_pools_cfuncs_call_no_x86_instruction_off_x86(tmp_path):
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", _NOT_X86], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    calls = json.loads(out.stdout)
    assert "_worker" in calls and "_parallel_for" in calls, calls
    assert not any(calls.values()), f"x86 instructions called: {calls}"

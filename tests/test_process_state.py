"""gpt2numba leaves the process as it found it: its environment, its OpenMP runtimes, BLAS's thread counts,
signal handlers, the directory, the locale, NumPy's state, other threads' CPUs (docs/api.md, "What gpt2numba
leaves as it found it"). Each check runs in a fresh process: a process picks its threading layer once."""

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import threading

import pytest

from gpt2numba.cpu import blas
from gpt2numba.model import products

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tbb_installed() -> bool:
    from importlib import metadata

    try:
        metadata.distribution("tbb")
    except metadata.PackageNotFoundError:
        return False
    return not {"NUMBA_THREADING_LAYER", "NUMBA_THREADING_LAYER_PRIORITY"} & set(os.environ)



# What a dependency writes into os.environ on its own import: the only keys allowed to change, each named in
# docs/api.md (test_each_allowed_variable_is_its_dependencys checks that it is that dependency's doing).
DEPENDENCY_VARIABLES = {"KMP_DUPLICATE_LIB_OK": "threadpoolctl"}

# Takes TBB away from the process it starts in, as where the tbb package is not installed (its library cannot
# load, its metadata is not found): Numba's own order then falls to OpenMP.
_HIDE_TBB = """
import ctypes
from importlib import metadata as _metadata
class _NoTBB(ctypes.CDLL):
    def __init__(self, name, *args, **kwargs):
        if name and "libtbb" in str(name):
            raise OSError(f"{name}: hidden by the test")
        super().__init__(name, *args, **kwargs)
ctypes.CDLL = _NoTBB
def _hidden(real):
    def look(name):
        if name == "tbb":
            raise _metadata.PackageNotFoundError(name)
        return real(name)
    return look
_metadata.distribution, _metadata.version = _hidden(_metadata.distribution), _hidden(_metadata.version)
"""
TBB_HERE = importlib.util.find_spec("numba") is not None and _tbb_installed()

# Every process-wide thing the library could change, read as plain JSON.
_STATE = """
def state():
    import locale, signal, threading, numpy as np
    from threadpoolctl import threadpool_info
    handlers = {}
    for sig in signal.valid_signals():
        try:
            handlers[int(sig)] = repr(signal.getsignal(sig))
        except (ValueError, OSError):
            pass
    return {"environ": dict(os.environ), "cwd": os.getcwd(), "locale": locale.setlocale(locale.LC_ALL),
            "signals": handlers, "umask": os.umask(os.umask(0o22)), "affinity": sorted(os.sched_getaffinity(0)),
            "numpy_print": repr(np.get_printoptions()), "numpy_errors": np.geterr(),
            "switch_interval": sys.getswitchinterval(), "recursion_limit": sys.getrecursionlimit(),
            "excepthooks": [repr(sys.excepthook), repr(threading.excepthook)],
            "blas_threads": sorted((i["filepath"], i["num_threads"]) for i in threadpool_info()
                                   if i["user_api"] == "blas")}
"""

# Imports gpt2numba and uses it the ways a user does; prints the state before and after, the OpenMP runtimes
# in the process (threadpoolctl and /proc/self/maps) and the threading layer.
_USE = _STATE + """
import os, sys
# Dependencies' own imports change what they change, before the first reading: threadpoolctl sets
# KMP_DUPLICATE_LIB_OK; on Python 3.10 the server's (anyio, through exceptiongroup) sets sys.excepthook.
import threadpoolctl
if "serve" in sys.argv:
    import starlette.testclient
before = state()
import numpy as np
import gpt2numba as g
from gpt2numba.cpu import threadlayer
w = g.random_weights(g.GPT2Config(n_layer=2, n_head=2, n_embd=128, n_positions=64), seed=0)
mc = g.ModelCache(w.config)
token = int(g.prefill([1, 2, 3], w, mc).argmax())
g.decode_step(token, w, mc)
caches = [g.ModelCache(w.config) for _ in range(2)]
g.prefill_batch([[1, 2], [3]], w, caches)
g.decode_batch([4, 5], w, caches)
list(g.generate([1, 2, 3], w, max_new_tokens=3, seed=0))
list(g.generate_batch([[1, 2], [3]], w, max_new_tokens=3, temperature=0.0))
g.score([1, 2, 3, 4], w)
if "serve" in sys.argv:
    from starlette.testclient import TestClient
    from gpt2numba.serve import create_app
    with TestClient(create_app(w, g.load_tokenizer(), max_batch=2)) as client:
        assert client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200
after = state()
maps = open("/proc/self/maps").read()
print(json.dumps({"before": before, "after": after, "layer": threadlayer.describe(),
                  "openmp_info": [i["filepath"] for i in threadpoolctl.threadpool_info() if i["user_api"] == "openmp"],
                  "openmp_maps": sorted({line.split()[-1] for line in maps.splitlines()
                                         if any(n in line for n in ("libgomp", "libiomp", "libomp"))})}))
"""


def _run(script: str, *args, env=None, hide_tbb=False) -> dict:
    done = subprocess.run([sys.executable, "-c", (_HIDE_TBB if hide_tbb else "") + "import json\n" + script, *args],
                          capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, **(env or {})})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


TBB_CASES = [pytest.param(False, id="tbb-loadable", marks=pytest.mark.skipif(
    not TBB_HERE, reason="the tbb package is not installed here, or a threading layer is chosen")),
    pytest.param(True, id="tbb-hidden")]


@pytest.mark.parametrize("hide_tbb", TBB_CASES)
def test_import_and_use_start_no_openmp_and_change_no_process_state(hide_tbb):
    """After import, a prefill, a decode, a batch, generate, generate_batch, score and the server's start, the
    process has no OpenMP runtime and its state is as before, but for DEPENDENCY_VARIABLES. With TBB hidden
    (a virtual environment's loader), Numba's own order would load GNU OpenMP: the layer is workqueue."""
    out = _run(_USE, "serve", hide_tbb=hide_tbb, env={"GPT2NUMBA_CLAIM_DIR": "off"})
    assert out["openmp_info"] == [] and out["openmp_maps"] == [], out["layer"]
    assert f"Numba's {'workqueue' if hide_tbb else 'tbb'} threading layer" in out["layer"]
    before, after = out["before"], out["after"]
    for variable in DEPENDENCY_VARIABLES:
        before["environ"].pop(variable, None), after["environ"].pop(variable, None)
    loaded_before = {path for path, _ in before["blas_threads"]}  # (SciPy's BLAS loads with gpt2numba)
    after["blas_threads"] = [[path, n] for path, n in after["blas_threads"] if path in loaded_before]
    assert after == before


def test_a_layer_the_user_names_is_honoured():
    """NUMBA_THREADING_LAYER=omp is the user's choice (and shows that the test above sees an OpenMP runtime)."""
    out = _run(_USE, env={"NUMBA_THREADING_LAYER": "omp", "GPT2NUMBA_CLAIM_DIR": "off"})
    assert out["openmp_maps"], out["layer"]
    assert "chosen by the user (omp)" in out["layer"]


def test_each_allowed_variable_is_its_dependencys():
    """Each key of DEPENDENCY_VARIABLES is set by importing its dependency alone, in a process without it."""
    for variable, dependency in DEPENDENCY_VARIABLES.items():
        env = {k: v for k, v in os.environ.items() if k != variable}
        done = subprocess.run([sys.executable, "-c", f"import os, {dependency}; print(os.environ.get({variable!r}))"],
                              capture_output=True, text=True, timeout=120, env=env)
        assert done.stdout.strip() not in ("", "None"), (variable, dependency, done.stderr)


_CHILD = """
import multiprocessing, os, subprocess, sys
import threadpoolctl
original = dict(os.environ)
import gpt2numba as g
w = g.random_weights(g.GPT2Config(n_layer=1, n_head=2, n_embd=64, n_positions=32, vocab_size=64), seed=0)
g.prefill([1, 2, 3], w, g.ModelCache(w.config))
child = subprocess.run([sys.executable, "-c", "import json, os; print(json.dumps(dict(os.environ)))"],
                       capture_output=True, text=True, check=True)
print(json.dumps({"original": original, "child": json.loads(child.stdout)}))
"""


@pytest.mark.parametrize("hide_tbb", TBB_CASES)
def test_a_child_process_sees_the_parents_environment(hide_tbb):
    """With TBB hidden, the code before issue 58 wrote OMP_WAIT_POLICY into os.environ, and the child saw it."""
    out = _run(_CHILD, hide_tbb=hide_tbb)
    out["child"].pop("LC_CTYPE", None)  # (Python's own coercion of the C locale, in any child)
    assert out["child"] == out["original"]


def _blas_counts() -> list[tuple[str, int]]:
    """(file, thread count) of each BLAS library loaded."""
    from threadpoolctl import threadpool_info

    return sorted((i["filepath"], i["num_threads"]) for i in threadpool_info() if i["user_api"] == "blas")


def test_overlapping_passes_put_blas_threads_back():
    """Two threads' passes that overlap without nesting (A in, B in, A out, B out) leave BLAS's thread counts
    as they were: one limit for all passes, lifted by the last to leave."""
    from threadpoolctl import threadpool_limits

    blas._thread_counts()  # (loads SciPy's BLAS, the one Numba calls, before the first reading)
    with threadpool_limits(limits=2, user_api="blas"):  # (from 2, so that 1 left behind shows)
        original = _blas_counts()
        assert original and all(n == 2 for _, n in original)
        a, b = products.one_blas_thread(), products.one_blas_thread()
        a.__enter__()
        b.__enter__()
        assert all(n == 1 for _, n in _blas_counts())
        a.__exit__(None, None, None)
        assert all(n == 1 for _, n in _blas_counts()), "a pass still runs: BLAS stays at one thread"
        b.__exit__(None, None, None)
        assert _blas_counts() == original


def test_a_pass_on_another_thread_runs_blas_on_one_thread():
    """threadpoolctl 3.8 lets only the first Python thread that limited OpenBLAS change its count; a pass run on
    another thread (the server's engine, a thread pool) still has every BLAS at one thread, and puts it back.
    (Before, its BLAS ran on all its threads there: other bits on AVX2, where a few rows already go to BLAS.)"""
    from threadpoolctl import threadpool_limits

    blas._thread_counts()  # (loads SciPy's BLAS first)
    with threadpool_limits(limits=2, user_api="blas"):  # this thread takes control of OpenBLAS (threadpoolctl 3.8)
        original, seen = _blas_counts(), {}

        def run():
            with products.one_blas_thread():
                seen["inside"] = _blas_counts()
            seen["after"] = _blas_counts()
        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
        assert original and all(n == 2 for _, n in original)
        assert all(n == 1 for _, n in seen["inside"]), seen
        assert seen["after"] == original

_WORKQUEUE_THREADS = """
import concurrent.futures, sys
sys.path.insert(0, "tests")
import numba, numpy as np
import gpt2numba.model.forward  # (its import launches Numba's layer)
import gpt2numba as g
from conftest import TINY
assert numba.threading_layer() == "workqueue", numba.threading_layer()
w = g.random_weights(TINY, seed=0)

def run(seed):
    ids = np.random.default_rng(seed).integers(0, TINY.vocab_size, 40)
    return [float(g.prefill(ids, w, g.ModelCache(TINY)).max()) for _ in range(4)]

alone = [run(seed) for seed in range(4)]
with concurrent.futures.ThreadPoolExecutor(4) as pool:
    together = list(pool.map(run, range(4)))
print(json.dumps(alone == together))
"""


def test_passes_from_several_threads_on_workqueue():
    """Where the regions run on workqueue (the pool off, no TBB), which aborts the process on regions from two
    threads at once, passes from several Python threads take turns and give what they give alone."""
    assert _run(_WORKQUEUE_THREADS, env={"GPT2NUMBA_POOL": "0", "NUMBA_THREADING_LAYER": "workqueue"}) is True


def test_a_pass_gives_its_caller_its_cpus_back():
    """The caller of a pass is pinned to one CPU while it runs alone (pool.pinned): after it, its affinity is
    what it was, in this thread and in another."""
    import gpt2numba as g
    from conftest import TINY

    w = g.random_weights(TINY, seed=0)
    seen = {}

    def run(name):
        before = os.sched_getaffinity(0)
        g.prefill([1, 2, 3], w, g.ModelCache(TINY))
        seen[name] = (before, os.sched_getaffinity(0))

    run("main")
    t = threading.Thread(target=run, args=("other",))
    t.start()
    t.join()
    assert all(before == after for before, after in seen.values()), seen


@pytest.mark.skipif(not TBB_HERE, reason="the tbb package is not installed here, or a threading layer is chosen")
def test_check_names_the_layer(tmp_path):
    """gpt2numba check prints where regions run and Numba's layer, whichever runs them."""
    import gpt2numba as g
    from conftest import TINY

    g.save_weights(g.random_weights(TINY, seed=0), tmp_path)
    for env in ({}, {"GPT2NUMBA_POOL": "0"}):
        done = subprocess.run([sys.executable, "-m", "gpt2numba", "check", "--model", str(tmp_path), "--prompts",
                               "1", "--prompt-len", "8", "--decode", "1"], capture_output=True, text=True,
                              timeout=300, env={**os.environ, **env})
        assert done.returncode == 0, done.stderr[-2000:]
        assert "Numba's tbb threading layer (TBB from" in done.stdout, done.stdout


def test_load_tbb_finds_the_wheels_copy(tmp_path):
    """With the loader unable to find libtbb.so.12 by name, load_tbb loads the tbb distribution's own file."""
    pytest.importorskip("numba")
    from importlib import metadata

    try:
        metadata.distribution("tbb")
    except metadata.PackageNotFoundError:
        pytest.skip("the tbb package is not installed here")
    script = textwrap.dedent("""
        import ctypes
        real = ctypes.CDLL
        class Loader(real):  # as the loader of a virtual environment: by name only once a copy is loaded
            loaded = False
            def __init__(self, name, *args, **kwargs):
                if name == "libtbb.so.12" and not Loader.loaded:
                    raise OSError("libtbb.so.12: cannot open shared object file (the test)")
                super().__init__(name, *args, **kwargs)
                Loader.loaded |= str(name).endswith("libtbb.so.12")
        ctypes.CDLL = Loader
        import numba
        import gpt2numba.model.forward  # (its import launches Numba's layer)
        from gpt2numba.cpu import threadlayer
        print(json.dumps([numba.threading_layer(), threadlayer.describe()]))
    """)
    used, described = _run(script)
    assert used == "tbb" and "TBB from the tbb package" in described, described

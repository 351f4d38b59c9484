"""The pool (gpt2numba/cpu/pool.py) outside the plain case: forked children, Python threads at once.

tests/test_pool.py checks the pool's own runtime (thread ids, nesting, the rescue); here, what a
user's process does around it. Each fork runs in a subprocess of its own, so that no thread of
this test process (pytest-xdist's among them) is in a forked child.
"""

import concurrent.futures
import functools
import os
import subprocess
import sys

import numba
import numpy as np
import pytest

import gpt2numba as g
from gpt2numba.cpu import pool
import gpt2numba.model.forward  # (its import launches Numba's layer and installs the pool)

from conftest import TINY

pytestmark = [
    pytest.mark.skipif(not pool.enabled(), reason="the pool is off here (GPT2NUMBA_POOL=0, or not x86-64)"),
    pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="needs 2 Numba threads"),
]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(script: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """``script`` in a fresh Python with tests/ importable, ``env`` added (None: a variable removed); fails
    the test on a non-zero exit."""
    env = {**os.environ, "PYTHONPATH": ROOT, **(env or {})}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT, env={k: v for k, v in env.items() if v is not None})
    assert done.returncode == 0, done.stdout + done.stderr
    return done


_FORK = """
import os, subprocess, sys, threading, warnings
import numpy as np
sys.path.insert(0, "tests")
import gpt2numba as g
from gpt2numba.cpu import pool
import gpt2numba.model.forward  # (its import launches Numba's layer and installs the pool)
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


def _passes(w, dtype_cache="float32"):
    """Prefill, decodes, a ragged batch prefill and a batch decode on ``w``: every logit, stacked rows."""
    mc = g.ModelCache(TINY, dtype=dtype_cache)
    rows = [g.prefill(np.arange(1, 50) * 7 % 512, w, mc)]
    for _ in range(3):
        rows.append(g.decode_step(int(rows[-1].argmax()), w, mc))
    caches = [g.ModelCache(TINY, dtype=dtype_cache) for _ in range(3)]
    rows.extend(g.prefill_batch([[5], [1, 2, 3], list(range(9, 40))], w, caches))
    rows.extend(g.decode_batch([4, 5, 6], w, caches))
    return np.stack(rows)


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_four_python_threads_at_once_give_the_bits_of_a_lone_call(dtype):
    """Four Python threads in passes at once (one runs each region on the pool, the others alone on
    their callers): every logit the same bits as the same calls made alone, round after round."""
    weights = [g.random_weights(TINY, seed=s, dtype=dtype) for s in range(4)]
    alone = [_passes(w) for w in weights]
    with concurrent.futures.ThreadPoolExecutor(4) as threads:
        for _ in range(3):
            together = list(threads.map(_passes, weights))
            for a, b in zip(alone, together):
                np.testing.assert_array_equal(a, b)


@pytest.mark.skipif(not pool._cpus, reason="the pool pins its threads only when they cover every CPU")
def test_only_a_lone_caller_is_pinned():
    """One thread in a pass is pinned to the first CPU; a second entering unpins it and is not pinned
    itself (pinned, both would share one CPU); each gets its CPUs back."""
    import threading

    g.prefill([1, 2, 3], g.random_weights(TINY, seed=0), g.ModelCache(TINY))  # the pool's threads started
    before = os.sched_getaffinity(0)
    first_in, second_done = threading.Event(), threading.Event()
    seen = {}

    def first():
        with pool.pinned():
            seen["first alone"] = os.sched_getaffinity(0)
            seen["first tid"] = threading.get_native_id()
            first_in.set()
            second_done.wait(60)
            seen["first after"] = os.sched_getaffinity(0)
        seen["first out"] = os.sched_getaffinity(0)

    def second():
        first_in.wait(60)
        with pool.pinned():
            seen["second"] = os.sched_getaffinity(0)
            seen["first, beside it"] = os.sched_getaffinity(seen["first tid"])
        second_done.set()

    a, b = threading.Thread(target=first), threading.Thread(target=second)
    a.start(), b.start()
    a.join(120), b.join(120)
    assert seen["first alone"] == {pool._cpus[0]}
    assert seen["second"] == seen["first, beside it"] == seen["first after"] == seen["first out"] == before


_FALL_BACK = """
import hashlib, sys, types, warnings
import numba
import numpy as np
from llvmlite import binding as ll
sys.path.insert(0, "tests")
warnings.simplefilter("always")
{patch}
with warnings.catch_warnings(record=True) as caught:
    import gpt2numba as g
    from gpt2numba.cpu import pool
    from conftest import TINY
    logits = g.prefill(np.arange(40) * 3 % 512, g.random_weights(TINY, seed=2), g.ModelCache(TINY))
ours = [str(w.message) for w in caught if "gpt2numba's thread pool is off" in str(w.message)]
print(repr(ours))
print(pool.describe())
print(pool.enabled(), ll.address_of_symbol("numba_parallel_for") == pool._parallel_for.address, len(pool._threads))
print(hashlib.sha256(logits.tobytes()).hexdigest())
"""

# the package's modules without its __init__, to patch pool.py before anything imports it
_EARLY_POOL = """
sys.modules["gpt2numba"] = types.ModuleType("gpt2numba")
sys.modules["gpt2numba"].__path__ = ["gpt2numba"]
import gpt2numba.cpu.pool
del sys.modules["gpt2numba"]
"""


def _fall_back(patch: str, env: dict | None = None, timeout: float = 300) -> tuple[list, str, str, str]:
    """The fall-back script's (warnings, describe(), 'enabled hooked threads', digest of the logits)."""
    lines = _run(_FALL_BACK.format(patch=patch), env, timeout).stdout.splitlines()
    return eval(lines[0]), lines[1], lines[2], lines[3]


@functools.cache
def _digest_fresh() -> str:
    """The digest of the same logits in a fresh process with the pool as it comes (not this one's: a test
    before may have left its threads or thresholds otherwise)."""
    return _run(_SIZED.format(patch=""), {}).stdout.splitlines()[-1]


def test_a_hook_called_otherwise_than_expected_falls_back_to_numbas_layer_with_one_warning():
    """A Numba that passes numba_parallel_for one array more than pool.py expects (simulated: the
    expectation changed): the self-check says so once, Numba's layer runs the regions, same logits."""
    patch = _EARLY_POOL + """
real = gpt2numba.cpu.pool._expected_call
gpt2numba.cpu.pool._expected_call = lambda n: {**real(n), "array_count": real(n)["array_count"] + 1}
"""
    warned, described, state, digest = _fall_back(patch)
    assert len(warned) == 1 and "not the expected" in warned[0] and "'array_count': 3" in warned[0], warned
    assert described.startswith("Numba's ") and "pool is off" in described and "array_count" in described
    assert state == "False False 0"
    assert digest == _digest_fresh()


def test_thread_ids_that_are_not_the_pools_fail_the_self_check():
    """A get_thread_id that does not know the pool's threads (simulated: their recorded ids wiped once
    they started): the probe's entries, run by those threads, report thread 0, and the check says so."""
    patch = _EARLY_POOL + """
real = gpt2numba.cpu.pool._start
def start():
    real()
    for k in range(1, gpt2numba.cpu.pool._state[gpt2numba.cpu.pool.NWORK] + 1):
        gpt2numba.cpu.pool._state[gpt2numba.cpu.pool.TIDS + 8 * k] = -1
gpt2numba.cpu.pool._start = start
"""
    warned, described, state, digest = _fall_back(patch)
    assert len(warned) == 1 and "thread ids [0]" in warned[0], warned
    assert state == "False False 0"
    assert digest == _digest_fresh()


# the pool's threads reach their loop ``late`` seconds after they say they started: as when the OS
# preempts them there on a busy machine, after the self-check's job is out
_LATE_THREADS = _EARLY_POOL + """
import threading, time
class Late(threading.Event):
    def set(self):
        super().set()
        if threading.current_thread().name.startswith("gpt2numba-pool-"):
            time.sleep({late})
late = types.ModuleType("threading")  # pool.py's threading, with the late Event
late.__dict__.update(threading.__dict__, Event=Late)
gpt2numba.cpu.pool.threading = late
"""


def test_a_pool_thread_that_comes_late_still_runs_the_self_checks_job():
    """The job out when a thread starts is one it looks at: the check passes, nothing hangs."""
    warned, described, state, digest = _fall_back(_LATE_THREADS.format(late=1.0), timeout=120)
    assert warned == [] and described.startswith("gpt2numba's pool"), (warned, described)
    assert state.startswith("True True")
    assert digest == _digest_fresh()


def test_a_pool_thread_that_does_not_come_within_the_wait_fails_the_self_check_without_a_hang():
    """Past the self-check's wait, its caller runs what is left (thread id 0) and the pool falls back."""
    patch = _LATE_THREADS.format(late=5.0) + "gpt2numba.cpu.pool._probe_timeout[:] = (0, 300_000_000)"
    warned, described, state, digest = _fall_back(patch, timeout=120)
    assert len(warned) == 1 and "thread ids [0]" in warned[0], warned
    assert state == "False False 0"
    assert digest == _digest_fresh()


def test_an_untested_numba_falls_back_unless_forced():
    """Simulated by a tested range that leaves this Numba out (patching numba.__version__ instead would
    rewrite every cached kernel: Numba's cache index records its version)."""
    patch = _EARLY_POOL + "gpt2numba.cpu.pool.TESTED_NUMBA = ((0, 50), (0, 51))"
    warned, described, state, _ = _fall_back(patch)
    assert len(warned) == 1 and f"Numba {numba.__version__} is outside" in warned[0], warned
    assert "0.50 to 0.51" in warned[0] and "pool is off" in described
    assert state == "False False 0"
    warned, described, state, _ = _fall_back(patch, {"GPT2NUMBA_POOL": "force"})
    assert warned == [] and described.startswith("gpt2numba's pool")
    assert state == f"True True {len(pool._threads)}"  # as many threads as this process's pool


# --- how many threads, on which CPUs --------------------------------------------------------------------

def _tree(tmp_path, proc: str, files: dict) -> tuple[str, str]:
    """A fake cgroup mount (root) and /proc/self/cgroup (proc): files maps a path under root to its text."""
    for name, text in files.items():
        (tmp_path / "root" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "root" / name).write_text(text)
    (tmp_path / "root").mkdir(exist_ok=True)
    (tmp_path / "cgroup").write_text(proc)
    return str(tmp_path / "root"), str(tmp_path / "cgroup")


def test_a_cgroup_v2_quota_is_the_smallest_on_the_way_up(tmp_path):
    root, proc = _tree(tmp_path, "0::/user.slice/app\n", {
        "user.slice/app/cpu.max": "max 100000\n", "user.slice/cpu.max": "150000 100000\n",
        "cpu.max": "400000 100000\n"})
    assert pool.cpu_quota(root, proc) == (1.5, os.path.join(root, "user.slice"))


def test_a_container_that_sees_only_its_own_cgroup_reads_the_root(tmp_path):
    root, proc = _tree(tmp_path, "0::/docker/abc\n", {"cpu.max": "100000 100000\n"})
    assert pool.cpu_quota(root, proc)[0] == 1.0
    root, proc = _tree(tmp_path / "none", "0::/\n", {"cpu.max": "max 100000\n"})
    assert pool.cpu_quota(root, proc) == (None, "")


def test_a_cgroup_v1_quota_is_read_from_the_cpu_controller(tmp_path):
    root, proc = _tree(tmp_path, "4:memory:/x\n3:cpu,cpuacct:/docker/abc\n", {
        "cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "50000\n", "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n",
        "memory/x/cpu.cfs_quota_us": "1000\n", "memory/x/cpu.cfs_period_us": "100000\n"})  # not the cpu controller
    assert pool.cpu_quota(root, proc)[0] == 0.5
    root, proc = _tree(tmp_path / "none", "1:cpu:/\n", {"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"})
    assert pool.cpu_quota(root, proc)[0] is None


def test_the_pool_is_sized_by_cpus_and_quota_and_the_environment_wins():
    top = numba.config.NUMBA_NUM_THREADS
    assert pool.size([0, 1], None, {})[0] == min(2, top)
    assert pool.size([0, 1], 1.0, {}) == (1, "a cgroup quota of 1 CPUs on 2 CPUs")
    assert pool.size([0, 1], 0.2, {})[0] == 1
    assert pool.size([0, 1, 2, 3], 1.5, {})[0] == min(2, top)
    assert pool.size([0, 1], 1.0, {"GPT2NUMBA_THREADS": "2"}) == (2, "$GPT2NUMBA_THREADS")
    assert pool.size([0, 1], 1.0, {"NUMBA_NUM_THREADS": str(top)}) == (top, "$NUMBA_NUM_THREADS")
    for bad in ("0", str(top + 1), "two"):
        with pytest.raises(g.ConfigError, match="GPT2NUMBA_THREADS must be an integer"):
            pool.size([0, 1], None, {"GPT2NUMBA_THREADS": bad})


_SIZED = """
import sys, types
import numpy as np
sys.path.insert(0, "tests")
{patch}
import gpt2numba as g
from gpt2numba.cpu import pool
import gpt2numba.model.forward  # (its import launches Numba's layer and installs the pool)
from conftest import TINY
logits = g.prefill(np.arange(40) * 3 % 512, g.random_weights(TINY, seed=2), g.ModelCache(TINY))
print(len(pool._threads) + 1, bool(pool._cpus))
print(pool.describe())
import hashlib; print(hashlib.sha256(logits.tobytes()).hexdigest())
"""


def test_a_quota_of_one_cpu_gives_a_pool_of_one_thread_unless_gpt2numba_threads_says_otherwise(tmp_path):
    root, proc = _tree(tmp_path, "0::/\n", {"cpu.max": "100000 100000\n"})
    patch = _EARLY_POOL + f"gpt2numba.cpu.pool.CGROUP_ROOT, gpt2numba.cpu.pool.PROC_CGROUP = {root!r}, {proc!r}"
    env = {"NUMBA_NUM_THREADS": None, "GPT2NUMBA_THREADS": None}
    threads, described, digest = _run(_SIZED.format(patch=patch), env).stdout.splitlines()
    assert threads == "1 False" and "a cgroup quota of 1 CPUs" in described
    assert digest == _digest_fresh()
    threads, described, _ = _run(_SIZED.format(patch=patch), {**env, "GPT2NUMBA_THREADS": "2"}).stdout.splitlines()
    assert threads.split()[0] == "2" and "$GPT2NUMBA_THREADS" in described


def test_set_threads_above_the_pools_size_grows_it():
    """A pool of one thread ($GPT2NUMBA_THREADS=1): set_threads(2) starts a second, which runs regions'
    entries, describe() says why, and the logits are the same bits."""
    script = """
import hashlib, sys
import numpy as np
sys.path.insert(0, "tests")
import gpt2numba as g
from gpt2numba.cpu import pool
import gpt2numba.model.forward  # (its import launches Numba's layer and installs the pool)
from conftest import TINY
before = len(pool._threads) + 1
g.set_threads(2)
logits = g.prefill(np.arange(40) * 3 % 512, g.random_weights(TINY, seed=2), g.ModelCache(TINY))
# the self-check's region leaves its entries to the pool's threads: None once thread 1 ran them
print(before, len(pool._threads) + 1, pool._self_check())
print(pool.describe())
print(hashlib.sha256(logits.tobytes()).hexdigest())
"""
    sizes, described, digest = _run(script, {"GPT2NUMBA_THREADS": "1"}).stdout.splitlines()
    assert sizes == "1 2 None", sizes
    assert "grown to 2 by set_threads" in described, described
    assert digest == _digest_fresh()


@pytest.mark.skipif(not pool._cpus, reason="the pool pins its threads only when they cover every CPU")
def test_a_pinned_pool_grown_before_its_first_pass_pins_only_its_cpus_and_a_forked_child_keeps_the_size(
        tmp_path):
    """A pinned pool of one thread a CPU grown by one before its first forward pass: the pass pins the
    first threads and leaves the added one free; a forked child starts a pool of the size asked, unpinned
    (the parent's claim), without a warning; the same bits."""
    cpus = len(pool._cpus)
    script = """
import hashlib, os, sys, warnings
import numpy as np
sys.path.insert(0, "tests")
warnings.simplefilter("error", RuntimeWarning)
import gpt2numba as g
from gpt2numba.cpu import pool
import gpt2numba.model.forward  # (its import launches Numba's layer and installs the pool)
from conftest import TINY
g.set_threads({n})
w = g.random_weights(TINY, seed=2)
logits = g.prefill(np.arange(40) * 3 % 512, w, g.ModelCache(TINY))
free = len(os.sched_getaffinity(int(pool._state[pool.TIDS + 8 * ({n} - 1)])))
print(len(pool._threads) + 1, free, pool.describe())
print(hashlib.sha256(logits.tobytes()).hexdigest(), flush=True)
pid = os.fork()
if pid == 0:
    same = np.array_equal(g.prefill(np.arange(40) * 3 % 512, w, g.ModelCache(TINY)), logits)
    print(len(pool._threads) + 1, same, pool.describe(), flush=True)
    os._exit(0)
os.waitpid(pid, 0)
"""
    env = {"GPT2NUMBA_THREADS": str(cpus), "NUMBA_NUM_THREADS": str(cpus + 1), "GPT2NUMBA_CLAIM_DIR": str(tmp_path)}
    parent, digest, child = _run(script.format(n=cpus + 1), env).stdout.splitlines()
    assert parent.startswith(f"{cpus + 1} {cpus} ") and "pinned one to a CPU" in parent, parent
    assert "grown to" in parent and "pinning failed" not in parent, parent
    assert child.startswith(f"{cpus + 1} True ") and "not pinned: CPU" in child, child


def test_a_cpu_id_past_1024_and_a_refused_pinning_are_told_not_fatal():
    """A process that may run on CPUs 0 and 1500 (simulated: the affinity the pool reads): the masks
    hold CPU 1500, pinning a thread there fails (no such CPU here), describe() says so, same logits."""
    patch = """
import os
real = os.sched_getaffinity
os.sched_getaffinity = lambda pid: {0, 1500} if pid == 0 else real(pid)
"""
    env = {"NUMBA_NUM_THREADS": "2"}
    threads, described, digest = _run(_SIZED.format(patch=patch), env).stdout.splitlines()
    assert threads == "2 True"
    assert "pinning failed: thread 1 to CPU 1500: Invalid argument" in described, described
    assert digest == _digest_fresh()


def test_gpt2numba_check_tells_where_regions_run_and_a_refused_pinning(tmp_path):
    from checkpoints import write_dir

    write_dir(g.random_weights(TINY, seed=3), tmp_path)
    script = f"""
import os, sys
real = os.sched_getaffinity
os.sched_getaffinity = lambda pid: {{0, 1500}} if pid == 0 else real(pid)
from gpt2numba.cli import main
sys.exit(main(["check", "--model", {str(tmp_path)!r}, "--prompts", "1", "--prompt-len", "5", "--decode", "1"]))
"""
    out = _run(script, {"NUMBA_NUM_THREADS": "2"}).stdout
    assert "parallel regions: gpt2numba's pool of 2 threads" in out, out
    assert "pinning failed: thread 1 to CPU 1500" in out, out


_CLAIMANT = """
import sys
import numpy as np
sys.path.insert(0, "tests")
import gpt2numba as g
from gpt2numba.cpu import pool
import gpt2numba.model.forward  # (its import launches Numba's layer and installs the pool)
from conftest import TINY
print(pool.describe(), flush=True)
g.prefill(np.arange(40) * 3 % 512, g.random_weights(TINY, seed=2), g.ModelCache(TINY))
print(pool.describe(), flush=True)
sys.stdin.readline()
"""


@pytest.mark.skipif(not pool._cpus, reason="the pool pins its threads only when they cover every CPU")
def test_a_second_process_on_claimed_cpus_runs_unpinned_and_says_why(tmp_path):
    """The first of two gpt2numba processes on the same CPUs pins its threads at its first forward pass;
    the second, and a child the first forks, find the CPUs claimed and run unpinned; once the first has
    ended, the next pins, even while the child it forked lives; a process that runs no pass claims nothing."""
    env = {**os.environ, "PYTHONPATH": ROOT, "GPT2NUMBA_CLAIM_DIR": str(tmp_path)}
    first = subprocess.Popen([sys.executable, "-c", _CLAIMANT], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, cwd=ROOT, env=env)
    try:
        assert "to be pinned one to a CPU at the first forward pass" in first.stdout.readline()
        assert first.stdout.readline().split("; AMX tiles")[0].endswith("pinned one to a CPU")
        claimed = f"not pinned: CPU {pool._cpus[0]} is claimed by gpt2numba process {first.pid}"
        second = _run(_SECOND, env)
        assert claimed in second.stdout and second.stdout.strip().endswith("[]"), second.stdout
    finally:
        first.communicate("\n", timeout=300)
    forked = _run(_FORKED_CLAIM, env).stdout.splitlines()
    assert forked[0].split("; AMX tiles")[0].endswith("pinned one to a CPU"), forked
    assert f"claimed by gpt2numba process {forked[2]}" in forked[1], forked
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"gpt2numba-cpu{c}.claim" for c in pool._cpus)
    orphan = subprocess.Popen([sys.executable, "-c", _ORPHAN], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, cwd=ROOT, env=env)
    try:  # the parent has ended; its child, which read its claim in the parent's files, lives on
        assert "not pinned: CPU" in orphan.stdout.readline()
        orphan.wait(timeout=300)
        third = _run(_SECOND, env).stdout
        assert "pinned one to a CPU" in third and "not pinned" not in third, third
    finally:
        orphan.stdin.write("\n")
        orphan.stdin.close()
    idle = tmp_path / "idle"
    idle.mkdir()
    _run("import gpt2numba", {**env, "GPT2NUMBA_CLAIM_DIR": str(idle)})
    assert not any(idle.iterdir()), "a process that ran no forward pass claimed CPUs"


_SECOND = """
from gpt2numba.cpu import pool
import gpt2numba.model.forward  # (its import launches Numba's layer and installs the pool)
with pool.pinned():  # a forward pass's entry
    print(pool.describe(), pool._cpus)
"""

# the parent pins and forks; the child runs unpinned, then waits on stdin after the parent has ended
_ORPHAN = """
import os, sys, warnings
import numpy as np
sys.path.insert(0, "tests")
import gpt2numba as g
from gpt2numba.cpu import pool
import gpt2numba.model.forward  # (its import launches Numba's layer and installs the pool)
from conftest import TINY

w = g.random_weights(TINY, seed=2)
g.prefill(np.arange(40) * 3 % 512, w, g.ModelCache(TINY))
warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads running
started, told = os.pipe()
if os.fork() == 0:
    g.prefill(np.arange(40) * 3 % 512, w, g.ModelCache(TINY))
    print(pool.describe(), flush=True)
    os.write(told, b"x")
    sys.stdin.readline()
    os._exit(0)
os.read(started, 1)  # the child has met the claim
"""

# the parent pins; its forked child's first region starts threads that find the parent's claim
_FORKED_CLAIM = """
import os, sys, warnings
import numpy as np
sys.path.insert(0, "tests")
import gpt2numba as g
from gpt2numba.cpu import pool
import gpt2numba.model.forward  # (its import launches Numba's layer and installs the pool)
from conftest import TINY

w = g.random_weights(TINY, seed=2)
g.prefill(np.arange(40) * 3 % 512, w, g.ModelCache(TINY))
print(pool.describe(), flush=True)
warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads running
pid = os.fork()
if pid == 0:
    g.prefill(np.arange(40) * 3 % 512, w, g.ModelCache(TINY))
    print(pool.describe(), flush=True)
    os._exit(0)
os.waitpid(pid, 0)
print(os.getpid(), flush=True)
"""

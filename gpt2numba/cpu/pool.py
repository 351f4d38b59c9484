"""Numba's parallel regions on threads of our own, pinned one to a CPU, that keep their cores on a busy machine.

With another busy process on the machine, TBB's workers lose: between regions they yield,
and the scheduler (EEVDF) gives a yielded core to the neighbour for a whole time slice; and
unpinned, our two threads end up queued on one CPU while the neighbour has the other to
itself (docs/performance.md, "A busy machine"). So install() points Numba's
``numba_parallel_for`` and ``get_thread_id`` at the cfuncs of regions.py, which run each
region on threads this module starts:

- As many threads as the process may keep busy (size): the CPUs of its affinity, fewer
  under a cgroup CPU quota; $GPT2NUMBA_THREADS, or an explicit $NUMBA_NUM_THREADS, wins.
  describe() says which, and any pinning the OS refused.
- When the threads cover every CPU the process may use, each is pinned to its own CPU (the
  caller only during a forward pass, and only while no other Python thread runs one:
  ``pinned()``). Then a neighbour shares one CPU with one thread. The threads are pinned at
  the process's first forward pass, once its claim on those CPUs holds (_settle, _claim): a
  second gpt2numba process on the same CPUs, or a forked child, finds them claimed and runs
  unpinned, instead of stacking its threads on the first's.
- A forked child starts its threads at its first region, not in the fork handler.

The hook's call is Numba's private ABI, copied: install() checks it at run time. It keeps
Numba's layer, with one warning, on a Numba outside the releases tested (TESTED_NUMBA), or
when one small region through the pool (_self_check) does not reach _parallel_for with the
arguments Numba's lowering gives it, or its entries do not run on the pool's threads under
their own thread ids. ``GPT2NUMBA_POOL=0`` in the environment keeps Numba's layer.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import errno
import fcntl
import math
import os
import platform
import sys
import threading
import warnings

import numba
import numpy as np
from llvmlite import binding as ll
from numba import njit, prange

from ..errors import ConfigError
from . import amx, numbacache, threadlayer
from .regions import (  # noqa: F401  (TIDS, RUNNING, MOVED, _rescue, _syscall, SYS_GETTID: for the tests)
    LAZY, MASK_WORDS, MAX_THREADS, MOVED, NWORK, PIN, PIN_FAILS, PROBE, PROBE_TS, RUNNING, SEEN, START,
    SYS_GETTID, GEN, TIDS, _futex_wake, _get_thread_id, _masks, _parallel_for, _rescue, _state, _syscall, _worker)

TESTED_NUMBA = ((0, 59), (0, 68))  # the oldest and newest Numba (major, minor) whose call the pool was tested with

# --- starting and stopping the threads ----------------------------------------------------------------

_threads: list[threading.Thread] = []
_cpus: list[int] = []


_off: list[str] = []  # why the pool fell back to Numba's layer at install, if it did
_probe_timeout = np.array([10, 0], np.int64)  # s, ns: how long the self-check waits for the pool's threads
HOOKED = ("numba_parallel_for", "get_thread_id")  # Numba's symbols the pool replaces


def enabled() -> bool:
    """Whether regions run on the pool: on x86-64 Linux (its system calls), unless GPT2NUMBA_POOL=0 or the
    install fell back to Numba's layer (an untested Numba, a failed self-check)."""
    return (os.environ.get("GPT2NUMBA_POOL", "1") != "0" and sys.platform.startswith("linux")
            and platform.machine() == "x86_64" and not _off)


def install() -> None:
    """Route Numba's parallel regions through the pool and start its threads (one fewer than Numba's).

    On a Numba outside TESTED_NUMBA (unless GPT2NUMBA_POOL=force), or when the self-check finds the
    hook called otherwise than this module expects, Numba's own layer keeps the regions: one
    RuntimeWarning says why, and describe() too.
    """
    from numba.np.ufunc import parallel

    try:
        parallel._launch_threads()  # Numba's layer first (threadlayer.launch chose it); ours replace its symbols
    except Exception:  # no layer loads here: the first parallel kernel will say so, as without the pool
        return
    why = _untested_numba()
    if why is None:
        numbas = {name: ll.address_of_symbol(name) for name in HOOKED}
        _start()
        _state[START] = ctypes.cast(_start_in_region, ctypes.c_void_p).value
        ll.add_symbol("numba_parallel_for", _parallel_for.address)
        ll.add_symbol("get_thread_id", _get_thread_id.address)
        atexit.register(_stop)
        os.register_at_fork(after_in_child=_after_fork)
        why = _self_check()
        if why is not None:
            _stop()
            for name, address in numbas.items():
                ll.add_symbol(name, address)
    if why is not None:
        _off.append(why)
        warnings.warn(f"gpt2numba's thread pool is off, parallel regions run on Numba's {numba.threading_layer()} "
                      f"threading layer: {why}", RuntimeWarning, stacklevel=2)


def _untested_numba() -> str | None:
    """Why this Numba is not one the pool was tested with, or None."""
    version = tuple(int(part) for part in numba.__version__.split(".")[:2])
    (lo, hi) = TESTED_NUMBA
    if lo <= version <= hi or os.environ.get("GPT2NUMBA_POOL") == "force":
        return None
    return (f"Numba {numba.__version__} is outside the releases its hook was tested with "
            f"({lo[0]}.{lo[1]} to {hi[0]}.{hi[1]}; GPT2NUMBA_POOL=force tries it)")


@njit(parallel=True, cache=True, fastmath=False)
def _probe(out):
    """out: int64 (n, 2): each iteration writes its index and the id of the thread that ran it."""
    for i in prange(out.shape[0]):
        out[i, 0] = i
        out[i, 1] = numba.get_thread_id()


def _expected_call(n_threads: int) -> dict:
    """The arguments _probe's region must reach _parallel_for with (Numba's parfor lowering and
    build_gufunc_wrapper): a schedule of one entry per thread, two arrays (the schedule and out), three
    symbolic dimensions (the schedule's width and out's two), Numba's thread count."""
    return {"total": n_threads, "array_count": 2, "inner_ndim": 3, "num_threads": n_threads, "regions": 1}


def _self_check() -> str | None:
    """Why the hook is unfit, or None: one region of _probe through the pool, its entries left to the pool's
    threads, must reach _parallel_for with the expected arguments, run every iteration once, and see
    thread ids of the pool's threads (those of _get_thread_id)."""
    n = numba.get_num_threads()
    workers = int(_state[NWORK]) if n > 1 else 0
    out = np.full((4 * n, 2), -1, np.int64)
    _state[SEEN: SEEN + 5] = 0
    _state[PROBE_TS] = _probe_timeout.ctypes.data
    _state[PROBE] = 2 if workers else 1
    try:
        _probe(out)
    except Exception as e:
        return f"the self-check's parallel region failed: {e!r}"
    finally:
        _state[PROBE] = 0
    seen = dict(zip(("total", "array_count", "inner_ndim", "num_threads", "regions"),
                    _state[SEEN: SEEN + 5].tolist()))
    expected = _expected_call(n)
    if seen != expected:
        return f"Numba called numba_parallel_for with {seen}, not the expected {expected}"
    if not np.array_equal(out[:, 0], np.arange(len(out))):
        return f"the self-check's region ran its iterations other than once each: {out[:, 0].tolist()}"
    ids = set(out[:, 1].tolist())
    allowed = set(range(1, workers + 1)) if workers else {0}
    if not ids <= allowed:
        return (f"the self-check's region saw thread ids {sorted(ids)}, not those of the pool's threads "
                f"{sorted(allowed)}")
    return None


# --- how many threads, on which CPUs ---------------------------------------------------------------

CGROUP_ROOT = "/sys/fs/cgroup"  # where the cgroup file systems are mounted (tests point it at a fake tree)
PROC_CGROUP = "/proc/self/cgroup"  # this process's cgroups


def cpu_quota(root: str | None = None, proc_cgroup: str | None = None) -> tuple[float | None, str]:
    """The CPUs' worth of time this process's cgroups may use, and where that was read; None if no quota.

    cgroup v2: ``cpu.max`` ("quota period" or "max period"); v1: ``cpu.cfs_quota_us`` over
    ``cpu.cfs_period_us`` (-1: none). The process's own cgroup and each above it count (the
    smallest quota wins); a path not found under ``root`` (a container that sees only its own
    cgroup) is read at ``root`` itself. By default, CGROUP_ROOT and PROC_CGROUP.
    """
    root, proc_cgroup = root or CGROUP_ROOT, proc_cgroup or PROC_CGROUP
    try:
        with open(proc_cgroup) as f:
            lines = [line.rstrip("\n").split(":", 2) for line in f if line.count(":") >= 2]
    except OSError:
        lines = []
    places = []  # (directory of the cgroup file system, the process's cgroup path in it, v2)
    for _, controllers, path in lines:
        if controllers == "":
            places.append((root, path, True))
            places.append((os.path.join(root, "unified"), path, True))  # (v2 beside v1: systemd's hybrid layout)
        elif "cpu" in controllers.split(","):
            places.append((os.path.join(root, controllers), path, False))
            places.append((os.path.join(root, "cpu"), path, False))
    best, where = None, ""
    for base, path, v2 in places:
        parts = [p for p in path.split("/") if p]
        dirs = [os.path.join(base, *parts[:i]) for i in range(len(parts), -1, -1)]
        for d in dirs:
            quota = _read_quota(d, v2)
            if quota is not None and (best is None or quota < best):
                best, where = quota, d
    return best, where


def _read_quota(directory: str, v2: bool) -> float | None:
    try:
        if v2:
            with open(os.path.join(directory, "cpu.max")) as f:
                quota, period = f.read().split()[:2]
            return None if quota == "max" else int(quota) / int(period)
        with open(os.path.join(directory, "cpu.cfs_quota_us")) as f:
            quota = int(f.read())
        with open(os.path.join(directory, "cpu.cfs_period_us")) as f:
            period = int(f.read())
        return None if quota < 0 else quota / period
    except (OSError, ValueError, ZeroDivisionError):
        return None


def size(cpus, quota: float | None, environ=os.environ) -> tuple[int, str]:
    """The pool's threads (the caller among them) for a process that may use ``cpus`` and a cgroup ``quota``
    (in CPUs), and why: $GPT2NUMBA_THREADS, else an explicit $NUMBA_NUM_THREADS, else the CPUs of the
    affinity, fewer under a quota (rounded up); never more than Numba's threads nor MAX_THREADS - 1."""
    top = numba.config.NUMBA_NUM_THREADS
    if environ.get("GPT2NUMBA_THREADS", "").strip():
        try:
            n, why = int(environ["GPT2NUMBA_THREADS"]), "$GPT2NUMBA_THREADS"
        except ValueError:
            n = None
        if n is None or not 1 <= n <= top:
            raise ConfigError(f"GPT2NUMBA_THREADS must be an integer in [1, {top}] (Numba's threads), "
                              f"got {environ['GPT2NUMBA_THREADS']!r}")
    elif environ.get("NUMBA_NUM_THREADS", "").strip():
        n, why = top, "$NUMBA_NUM_THREADS"
    else:
        n, why = min(top, max(1, len(cpus))), f"the {len(cpus)} CPUs this process may run on"
        if quota is not None and math.ceil(quota) < n:
            n, why = max(1, math.ceil(quota)), f"a cgroup quota of {quota:g} CPUs on {len(cpus)} CPUs"
    if n > MAX_THREADS - 1:
        n, why = MAX_THREADS - 1, f"{why}, cut to the pool's largest, {MAX_THREADS - 1}"
    return n, why


_sized: list[str] = []  # why the pool has the threads it has
_pin_failures: list[str] = []  # pinnings refused by the OS, from Python (the threads' own: PIN_FAILS)


def _start(settle: bool = False) -> None:
    """Start the pool's threads, unpinned; when they cover every CPU, they are pinned at the process's first
    forward pass (_settle; at once with ``settle``), once its claim on those CPUs holds."""
    cpus = sorted(os.sched_getaffinity(0))
    n, why = size(cpus, cpu_quota()[0])
    _sized[:] = [why]
    pin = len(cpus) == n > 1  # pinned only when the threads cover every CPU: else processes would stack
    _cpus[:] = cpus if pin else []
    _masks[:] = 0
    if max(cpus, default=0) >= 64 * _masks.shape[1]:  # a CPU the masks cannot hold (not the machine's at import)
        _cpus[:], pin = [], False
        _pin_failures.append(f"CPU {max(cpus)} is past the {64 * _masks.shape[1]} the masks hold")
    _state[MASK_WORDS] = _masks.shape[1]
    for k, cpu in enumerate(_cpus):
        _masks[k, cpu // 64] = np.uint64(1) << np.uint64(cpu % 64)
    _spawn(range(1, n))
    _state[NWORK] = n - 1
    _unsettled[:] = [True] if pin else []
    if _asked and _asked[0] > n:  # a set_threads above the size, before a fork
        grow(_asked[0])
    if settle and pin:
        _settle()


def _spawn(ks) -> None:
    """Start pool threads ``ks`` (each records its native id first)."""
    run = ctypes.CFUNCTYPE(None, ctypes.c_int64)(_worker.address)
    started = []
    for k in ks:
        ready = threading.Event()

        def body(k=k, ready=ready):
            _state[TIDS + 8 * k] = threading.get_native_id()
            ready.set()
            run(k)  # ctypes lets the GIL go for the thread's whole life

        t = threading.Thread(target=body, name=f"gpt2numba-pool-{k}", daemon=True)
        t.start()
        started.append((t, ready))
    for t, ready in started:
        ready.wait()
        _threads.append(t)


def grow(n: int) -> None:
    """At least ``n`` threads, the caller among them: set_threads above the pool's size (a cgroup quota's,
    $GPT2NUMBA_THREADS') starts the rest. They run on any CPU of the process (their mask, where a rescue
    would pin them back, is all of them): the pool's size was what the process may keep busy, and the user
    asked for more."""
    n = min(n, MAX_THREADS - 1)
    if not enabled():
        return
    with _grow_lock:
        _asked[:] = [max([n, *_asked])]
        have = int(_state[NWORK]) + 1
        if _state[LAZY] or n <= have:  # (LAZY: a forked child starts its pool, _asked's size, at its first region)
            return
        for k in range(have, n):
            for cpu in os.sched_getaffinity(0):
                _masks[k, cpu // 64] |= np.uint64(1) << np.uint64(cpu % 64)
        _spawn(range(have, n))
        _state[NWORK] = n - 1
        _sized[1:] = [f"grown to {n} by set_threads, the added threads unpinned"]


_asked: list[int] = []  # the largest size set_threads asked of the pool, if above it
_grow_lock = threading.Lock()


def _settle() -> None:
    """Claim the CPUs and pin the pool's threads to them, or, another process's claim found, leave them
    unpinned: at the first forward pass, so that a process that never runs one (a Ray driver) leaves the
    CPUs to its workers. Threads grown past the CPUs (grow) stay unpinned."""
    _unsettled.clear()
    refused = _claim(_cpus)
    if refused:
        _cpus.clear()
        _unpinned[:] = [refused]
        return
    for k in range(1, min(int(_state[NWORK]) + 1, len(_cpus))):  # (threads grown past the CPUs stay unpinned)
        try:
            os.sched_setaffinity(int(_state[TIDS + 8 * k]), {_cpus[k]})
        except OSError as e:
            _pin_failures.append(f"thread {k} to CPU {_cpus[k]}: {e.strerror or e}")
    _state[PIN] = 1


CLAIM_DIR = "/dev/shm"  # where the claims on CPUs live, unless $GPT2NUMBA_CLAIM_DIR says otherwise
_claims: list[int] = []  # descriptors of this process's claim files, one per CPU its threads are pinned to
_unpinned: list[str] = []  # why threads that cover every CPU are not pinned (another process's claim)
_unsettled: list[bool] = []  # [True] while the threads wait for the first forward pass to be pinned


def _claim(cpus) -> str | None:
    """Claim ``cpus`` for this process's pinned threads; None once claimed, else why not.

    A claim is an exclusive flock on one file per CPU (``gpt2numba-cpu<N>.claim`` under
    $GPT2NUMBA_CLAIM_DIR, default /dev/shm, holding the claimant's pid), kept while the process
    lives: the OS lets go when it ends, however it ends. A CPU claimed by another process means
    two pools pinned to the same CPUs, each thread sharing its CPU with the other's. Claims
    are off with $GPT2NUMBA_CLAIM_DIR=off, or where no claim file can be opened (pinned then,
    as without claims).
    """
    where = os.environ.get("GPT2NUMBA_CLAIM_DIR", "").strip() or CLAIM_DIR
    if where == "off":
        return None
    taken = []
    for cpu in cpus:
        path = os.path.join(where, f"gpt2numba-cpu{cpu}.claim")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        except OSError:
            try:  # another user's file: it can still be locked
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                _release(taken)
                return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            try:
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):  # no flock here: pinned, as without claims
                    return None
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
                return f"CPU {cpu} is claimed by gpt2numba process {holder}"
            finally:
                os.close(fd)
                _release(taken)
        with contextlib.suppress(OSError):  # (OSError: read-only; the claim holds, without a pid to tell)
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(os.getpid()).encode(), 0)
        taken.append(fd)
    _claims[:] = taken
    return None


def _release(fds: list[int]) -> None:
    """Close the claim files ``fds`` and empty the list."""
    for fd in fds:
        os.close(fd)
    fds.clear()


def _stop() -> None:
    """Let the threads return (before the interpreter frees what they read), and the claims go."""
    _state[NWORK] = 0
    _state[GEN] = -2
    _futex_wake(GEN)
    for t in _threads:
        t.join(timeout=1.0)
    _threads.clear()
    _release(_claims)


def _after_fork() -> None:
    """In a forked child only the forking thread exists. Its regions run on it alone until the first one
    starts the pool's threads (_start_in_region): a child that only execs, such as the one between fork
    and exec of ``subprocess.Popen(preexec_fn=...)``, never starts a thread."""
    global _passes_lock, _grow_lock
    if _off:
        return
    _threads.clear()
    _passes.clear()  # (the other threads in passes are not in the child)
    _holder.clear()
    _passes_lock = threading.Lock()  # another thread may have held it at the fork
    _grow_lock = threading.Lock()
    start = _state[START]
    _state[:] = 0
    _state[START] = start
    _state[LAZY] = 1
    _pin_failures.clear()
    _release(_claims)  # the parent's claims stay the parent's: this child's start finds them taken
    _unpinned.clear()
    _unsettled.clear()


@ctypes.CFUNCTYPE(None)
def _start_in_region() -> None:
    """_start, called from the first parallel region after a fork (ctypes takes the GIL, which the region
    has let go); the threads are settled at once (the child's first region is most likely its first pass's)."""
    try:
        _start(settle=True)
    except Exception as e:  # the region runs on its caller alone, as before a start
        warnings.warn(f"gpt2numba's pool could not start its threads after a fork ({e!r}); parallel "
                      f"regions run on their caller alone", RuntimeWarning, stacklevel=1)


def describe() -> str:
    """Where this process's parallel regions run, and whether on Intel's matrix tiles (amx.py), for reports."""
    if not enabled():
        off = f" (gpt2numba's pool is off: {_off[0]})" if _off else ""
        return f"{threadlayer.describe()}{off}; AMX tiles {amx.describe()}"
    n = int(_state[NWORK]) + 1
    out = f"gpt2numba's pool of {n} thread{'s' * (n > 1)}"
    if _sized:
        out += f" ({'; '.join(_sized)})"
    if _cpus:
        out += ", to be pinned one to a CPU at the first forward pass" if _unsettled else ", pinned one to a CPU"
    out += f", not pinned: {_unpinned[0]}" if _unpinned else ""
    failed = _pin_failures + ([f"{_state[PIN_FAILS]} in the pool's threads"] if _state[PIN_FAILS] else [])
    out += f"; pinning failed: {'; '.join(failed)}" if failed else ""
    return f"{out}; AMX tiles {amx.describe()}"


_passes: dict[int, int] = {}  # native id of each Python thread inside a pass: how deep
_holder: list = []  # [native id, its CPUs before] of the one caller pinned, if any
_passes_lock = threading.Lock()


class pinned:
    """A forward pass: its caller is pinned to the first CPU while it is the only Python thread in a pass.

    Pinned, the caller keeps a CPU of its own beside the pool's threads. Two or more callers at once are
    none of them pinned (the first is unpinned when the second enters): pinned, they would all share the
    first CPU, where the one running a region on the pool spins while the others wait for it.
    """

    def __enter__(self):
        me = threading.get_native_id()
        with _passes_lock:
            if _unsettled:
                _settle()
            _passes[me] = _passes.get(me, 0) + 1
            if len(_passes) > 1:
                _unpin_holder()
            elif not _holder and _cpus and _state[NWORK] and numba.get_num_threads() > 1:
                before = os.sched_getaffinity(0)
                try:
                    os.sched_setaffinity(0, {_cpus[0]})
                    _holder[:] = [me, before]
                except OSError as e:  # the CPU is no longer ours to use: run unpinned
                    if len(_pin_failures) < 8:
                        _pin_failures.append(f"a caller to CPU {_cpus[0]}: {e.strerror or e}")
        return self

    def __exit__(self, *exc):
        me = threading.get_native_id()
        with _passes_lock:
            _passes[me] -= 1
            if not _passes[me]:
                del _passes[me]
                if _holder and _holder[0] == me:
                    _unpin_holder()


def _unpin_holder() -> None:
    """Give the pinned caller, if any, back the CPUs it had (under _passes_lock)."""
    if _holder:
        tid, before = _holder
        _holder.clear()
        with contextlib.suppress(OSError):  # (OSError: the thread has ended)
            os.sched_setaffinity(tid if tid != threading.get_native_id() else 0, before)


numbacache.guard(__name__)  # this module's cached kernels load and save under a lock (numbacache.py)

"""Numba's parallel regions on threads of our own, pinned one to a CPU, that keep their cores on a busy machine.

Every prange in the kernels compiles to a call of the symbol ``numba_parallel_for`` with a
schedule of entries (one per thread, each a run of the prange's iterations) and a gufunc
that runs them; Numba's threading layer provides the symbol. With another busy process on
the machine, TBB's workers lose: between regions they yield, and the scheduler (EEVDF)
gives a yielded core to the neighbour for a whole time slice; and unpinned, our two
threads end up queued on one CPU while the neighbour has the other to itself
(docs/performance.md, "A busy machine").

So this module points ``numba_parallel_for`` (and ``get_thread_id``) at its own cfuncs, which
run each schedule on a pool of threads of ours, the caller among them:

- A job is published under GEN: odd while the caller writes it, even once it may be read.
  Threads claim entries with a compare-and-swap on NEXT, whose high half is the GEN the
  entry belongs to, so a thread that read a job late can never run an entry of the next.
- Waiting spins (``pause``, never a yield), then sleeps on a futex.
- The pool has as many threads as the process may keep busy (size): the CPUs of its
  affinity, fewer under a cgroup CPU quota; $GPT2NUMBA_THREADS, or an explicit
  $NUMBA_NUM_THREADS, wins. describe() says which, and any pinning the OS refused.
- When the threads cover every CPU the process may use, each is pinned to its own CPU (the
  caller only during a forward pass, and only while no other Python thread runs one:
  ``pinned()``). Then a neighbour shares one CPU with one thread. If it preempts that
  thread in the middle of an entry, the caller, once idle, sees that the thread's CPU time
  has stopped and moves the thread to its own CPU; the thread pins itself back once it has
  run its entries.

Which thread runs an entry never changes what the entry computes (chunks.py), so results
are the same bits as under Numba's own layer. A region started while another runs (another
Python thread, or a prange inside a prange) runs on its caller alone. ``GPT2NUMBA_POOL=0``
in the environment keeps Numba's threading layer.

The hook's call is Numba's private ABI, copied here: install() checks it at run time. It
keeps Numba's layer, with one warning, on a Numba outside the releases tested
(TESTED_NUMBA), or when one small region through the pool (_self_check) does not reach
_parallel_for with the arguments Numba's lowering gives it, or its entries do not run on the
pool's threads under their own thread ids.
"""

from __future__ import annotations

import atexit
import ctypes
import math
import os
import platform
import sys
import threading
import warnings

import numba
import numpy as np
from llvmlite import binding as ll, ir
from numba import cfunc, njit, prange, types
from numba.extending import intrinsic

from .errors import ConfigError

SPIN = 4000  # pauses (25-40 ns each) a waiting thread spins before it sleeps
CHECK = 256  # pauses between the caller's looks at a thread that holds an entry
SPACE = 256  # per thread: room for one entry's argument pointers and counts

# the state: int64 words; those written by different threads a cache line apart
GEN, BUSY, SLEEPERS, WAITING, NEXT, DONE = 0, 8, 16, 24, 32, 40
FN, ARGS, DIMS, STEPS, DATA, NARR, NDIM, TOTAL, NTHREADS, NWORK, PIN, LAZY, START = range(48, 61)
# the self-check (_self_check): PROBE 1 records a region's arguments in SEEN, 2 also leaves its entries to the
# pool's threads; PROBE_TS: address of the timespec the caller then waits at most
PROBE, PROBE_TS, SEEN = 64, 65, 66  # SEEN..SEEN+4: total, array_count, inner_ndim, num_threads, regions
MASK_WORDS, PIN_FAILS = 72, 73  # 64-bit words of a CPU mask; failed pinnings in the threads
MAX_THREADS = 1024  # (the arrays below are zeros the OS maps only once written: a few pages in use)
PER_THREAD = 8 * MAX_THREADS  # words of each per-thread array: thread k's (0 is the caller) at 8 k
TIDS, RUNNING, MOVED, SEEN_CPU = (128 + i * PER_THREAD for i in range(4))
WORDS = 128 + 4 * PER_THREAD
_state = np.zeros(WORDS, np.int64)
_space = np.zeros((MAX_THREADS, 2, SPACE), np.int64)  # per thread: argument pointers, counts



def _mask_words(cpus) -> int:
    """64-bit words of a CPU mask that holds every CPU id of ``cpus`` and of the machine's possible ones."""
    top = max(cpus, default=0)
    try:
        with open("/sys/devices/system/cpu/possible") as f:  # e.g. "0-127"
            top = max(top, int(f.read().strip().replace(",", "-").split("-")[-1]))
    except (OSError, ValueError):
        top = max(top, (os.cpu_count() or 1) - 1)
    return max(16, top // 64 + 1)


_masks = np.zeros((MAX_THREADS, _mask_words(os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity")
                                            else ())), np.uint64)  # per thread: its CPU
ll.add_symbol("gpt2numba_pool_state", _state.ctypes.data)
ll.add_symbol("gpt2numba_pool_space", _space.ctypes.data)
ll.add_symbol("gpt2numba_pool_masks", _masks.ctypes.data)

SYS_GETTID, SYS_FUTEX, SYS_SCHED_SETAFFINITY, SYS_CLOCK_GETTIME, SYS_GETCPU = 186, 202, 203, 228, 309  # x86-64
FUTEX_WAIT, FUTEX_WAKE = 128, 129  # the process-private forms
ETIMEDOUT = 110
TESTED_NUMBA = ((0, 59), (0, 68))  # the oldest and newest Numba (major, minor) whose call the pool was tested with
_MASK32 = (1 << 32) - 1

_i64, _i8p = ir.IntType(64), ir.IntType(8).as_pointer()


def _global(builder, name):
    """The address, as int64, of one of the buffers above (resolved when the code is linked, so cacheable)."""
    g = builder.module.globals.get(name)
    if g is None:
        g = ir.GlobalVariable(builder.module, _i64, name)
        g.linkage = "external"
    return builder.ptrtoint(g, _i64)


@intrinsic
def _base(typingctx, which):
    """Address of the state (0), the spaces (1) or the masks (2)."""
    names = ("gpt2numba_pool_state", "gpt2numba_pool_space", "gpt2numba_pool_masks")

    def codegen(context, builder, sig, args):
        out = [_global(builder, n) for n in names]
        return builder.select(builder.icmp_signed("==", args[0], _i64(0)), out[0],
                              builder.select(builder.icmp_signed("==", args[0], _i64(1)), out[1], out[2]))
    return types.int64(types.int64), codegen


def _p(builder, addr):
    return builder.inttoptr(addr, _i64.as_pointer())


@intrinsic
def _load(typingctx, addr):
    def codegen(context, builder, sig, args):
        return builder.load_atomic(_p(builder, args[0]), "acquire", 8)
    return types.int64(types.int64), codegen


@intrinsic
def _store(typingctx, addr, value):
    def codegen(context, builder, sig, args):
        builder.store_atomic(args[1], _p(builder, args[0]), "release", 8)
        return context.get_dummy_value()
    return types.none(types.int64, types.int64), codegen


@intrinsic
def _add(typingctx, addr, value):
    """*addr += value, sequentially consistent; returns the value before."""
    def codegen(context, builder, sig, args):
        return builder.atomic_rmw("add", _p(builder, args[0]), args[1], "seq_cst")
    return types.int64(types.int64, types.int64), codegen


@intrinsic
def _cas(typingctx, addr, old, new):
    """Whether *addr went from old to new."""
    def codegen(context, builder, sig, args):
        pair = builder.cmpxchg(_p(builder, args[0]), args[1], args[2], "seq_cst", "seq_cst")
        return builder.extract_value(pair, 1)
    return types.boolean(types.int64, types.int64, types.int64), codegen


@intrinsic
def _pause(typingctx):
    def codegen(context, builder, sig, args):
        fn = builder.module.declare_intrinsic("llvm.x86.sse2.pause", fnty=ir.FunctionType(ir.VoidType(), []))
        builder.call(fn, [])
        return context.get_dummy_value()
    return types.none(), codegen


@intrinsic
def _syscall(typingctx, number, a, b, c, d):
    """libc's syscall(number, a, b, c, d), every argument an integer."""
    def codegen(context, builder, sig, args):
        fn = builder.module.globals.get("syscall")
        if fn is None:
            fn = ir.Function(builder.module, ir.FunctionType(_i64, [_i64], var_arg=True), "syscall")
        return builder.call(fn, list(args))
    return types.int64(types.int64, types.int64, types.int64, types.int64, types.int64), codegen


@intrinsic
def _call_kernel(typingctx, fn, args, dims, steps, data):
    """fn(args, dims, steps, data): a gufunc's inner loop, every argument an address."""
    def codegen(context, builder, sig, llargs):
        fnty = ir.FunctionType(ir.VoidType(), [_i8p.as_pointer(), _i64.as_pointer(), _i64.as_pointer(), _i8p])
        f = builder.inttoptr(llargs[0], fnty.as_pointer())
        builder.call(f, [builder.inttoptr(llargs[1], _i8p.as_pointer()), _p(builder, llargs[2]),
                         _p(builder, llargs[3]), builder.inttoptr(llargs[4], _i8p)])
        return context.get_dummy_value()
    return types.none(types.int64, types.int64, types.int64, types.int64, types.int64), codegen


@intrinsic
def _call_void(typingctx, fn):
    """fn(): a C function without arguments or result, at an address."""
    def codegen(context, builder, sig, llargs):
        f = builder.inttoptr(llargs[0], ir.FunctionType(ir.VoidType(), []).as_pointer())
        builder.call(f, [])
        return context.get_dummy_value()
    return types.none(types.int64), codegen


@intrinsic
def _address(typingctx, p):
    def codegen(context, builder, sig, args):
        return builder.ptrtoint(args[0], _i64)
    return types.int64(types.voidptr), codegen


@njit(nogil=True, cache=True, inline="always")
def _at(word):
    return _base(0) + 8 * word


@njit(nogil=True, cache=True)
def _futex_wait(word, expected, timeout):
    """-ETIMEDOUT once ``timeout`` (the address of a timespec; 0: none) has passed."""
    return _syscall(SYS_FUTEX, _at(word), FUTEX_WAIT, expected & _MASK32, timeout)


@njit(nogil=True, cache=True)
def _futex_wake(word):
    _syscall(SYS_FUTEX, _at(word), FUTEX_WAKE, 1 << 30, 0)


@njit(nogil=True, cache=True)
def _sleep_while(word, value, count, timeout=0):
    """Sleep while ``word`` holds ``value``; ``count`` tells the writer someone is asleep and needs waking.
    Returns whether a ``timeout`` (see _futex_wait) ended the sleep."""
    _add(_at(count), 1)
    out = 0
    if _load(_at(word)) == value:
        out = _futex_wait(word, value, timeout)
    _add(_at(count), -1)
    return out == -ETIMEDOUT


@njit(nogil=True, cache=True)
def _pin(tid, k):
    """Pin thread ``tid`` (0: the calling one) to thread k's CPU; a failure is counted in PIN_FAILS."""
    words = _load(_at(MASK_WORDS))
    if _syscall(SYS_SCHED_SETAFFINITY, tid, 8 * words, _base(2) + 8 * words * k, 0) < 0:
        _add(_at(PIN_FAILS), 1)


@njit(nogil=True, cache=True)
def _cpu_ns(tid):
    """CPU time of thread ``tid`` in ns (its clock, CLOCK_THREAD_CPUTIME of another thread)."""
    ts = np.zeros(2, np.int64)
    _syscall(SYS_CLOCK_GETTIME, ((~tid) << 3) | 6, ts.ctypes.data, 0, 0)
    return ts[0] * 1_000_000_000 + ts[1]


@njit(nogil=True, cache=True)
def _run_entries(g, k):
    """As thread k, claim entries of the job published under GEN g and run them until none is left."""
    fn, args, dims, steps = _load(_at(FN)), _load(_at(ARGS)), _load(_at(DIMS)), _load(_at(STEPS))
    data, n_arr, n_dim, total = _load(_at(DATA)), _load(_at(NARR)), _load(_at(NDIM)), _load(_at(TOTAL))
    if _load(_at(GEN)) != g or k >= _load(_at(NTHREADS)):  # over, or not for as many threads as this
        return
    argv = _base(1) + 8 * 2 * SPACE * k
    countv = argv + 8 * SPACE
    tag = g & _MASK32
    while True:
        w = _load(_at(NEXT))
        i = w & _MASK32
        if (w >> 32) & _MASK32 != tag or i >= total:
            return
        if not _cas(_at(NEXT), w, w + 1):
            continue
        for j in range(1, n_dim + 1):
            _store(countv + 8 * j, _load(dims + 8 * j))
        _store(countv, 1)
        for j in range(n_arr):
            _store(argv + 8 * j, _load(args + 8 * j) + _load(steps + 8 * j) * i)
        _store(_at(RUNNING + 8 * k), 1)
        _call_kernel(fn, argv, countv, steps, data)
        _store(_at(RUNNING + 8 * k), 0)
        if _add(_at(DONE), 1) + 1 == total and _load(_at(WAITING)) != 0:
            _futex_wake(DONE)


@njit(nogil=True, cache=True)
def _pin_back(k):
    """If the caller moved thread k to its CPU (_rescue), pin it back to its own."""
    if _load(_at(MOVED + 8 * k)):
        _store(_at(MOVED + 8 * k), 0)
        _pin(0, k)


@cfunc(types.void(types.int64), cache=True)
def _worker(k):
    """Thread k's life: wait for a job, run its entries, until GEN goes negative."""
    seen = _load(_at(GEN))
    while True:
        spins = 0
        g = _load(_at(GEN))
        while g == seen or g & 1:
            if spins < SPIN:
                _pause()
                spins += 1
            else:
                _sleep_while(GEN, g, SLEEPERS)
            g = _load(_at(GEN))
        if g < 0:
            return
        seen = g
        _pin_back(k)  # moved after its last look at the end of the previous job
        _run_entries(g, k)
        _pin_back(k)


@njit(nogil=True, cache=True)
def _rescue(n_threads):
    """Move each thread that holds an entry but has not run since the last look to the caller's CPU."""
    here = -1  # a scratch mask of the caller's CPU, written when a thread first needs it
    for k in range(1, n_threads):
        if _load(_at(RUNNING + 8 * k)):
            tid = _load(_at(TIDS + 8 * k))
            ns = _cpu_ns(tid)
            if ns == _load(_at(SEEN_CPU + 8 * k)) and not _load(_at(MOVED + 8 * k)):
                if here < 0:
                    here = _caller_mask()
                if here >= 0:
                    _store(_at(MOVED + 8 * k), 1)
                    if _syscall(SYS_SCHED_SETAFFINITY, tid, 8 * _load(_at(MASK_WORDS)), here, 0) < 0:
                        _add(_at(PIN_FAILS), 1)
            _store(_at(SEEN_CPU + 8 * k), ns)


@njit(nogil=True, cache=True)
def _caller_mask():
    """Address of a mask of the CPU the caller runs on (the masks' last row), or -1 past the masks' CPUs."""
    cpu = np.zeros(2, np.uint32)
    _syscall(SYS_GETCPU, cpu.ctypes.data, 0, 0, 0)
    c = np.int64(cpu[0])
    words = _load(_at(MASK_WORDS))
    if c >= 64 * words:
        return -1
    here = _base(2) + 8 * words * (MAX_THREADS - 1)
    for j in range(words):
        _store(here + 8 * j, 0)
    _store(here + 8 * (c // 64), np.int64(1) << (c % 64))
    return here


@cfunc(types.void(types.voidptr, types.voidptr, types.voidptr, types.voidptr, types.voidptr,
                  types.intp, types.intp, types.intp), cache=True)
def _parallel_for(fn, args, dims, steps, data, inner_ndim, array_count, num_threads):
    """Numba's numba_parallel_for: run the schedule's entries (dims[0] of them) on up to num_threads threads."""
    f, a, d, st, dt = _address(fn), _address(args), _address(dims), _address(steps), _address(data)
    if _load(_at(LAZY)) != 0 and _cas(_at(LAZY), 1, 0):  # the first region since a fork: start the threads
        _call_void(_load(_at(START)))
    total = _load(d)
    probe = _load(_at(PROBE))
    if probe != 0:
        _store(_at(SEEN), total)
        _store(_at(SEEN + 1), array_count)
        _store(_at(SEEN + 2), inner_ndim)
        _store(_at(SEEN + 3), num_threads)
        _add(_at(SEEN + 4), 1)
    n_threads = min(num_threads, _load(_at(NWORK)) + 1)
    if (n_threads <= 1 or total <= 1 or array_count > SPACE or inner_ndim + 1 > SPACE
            or not _cas(_at(BUSY), 0, 1)):
        _call_kernel(f, a, d, st, dt)  # here, alone: the gufunc runs every entry itself
        return
    g = _load(_at(GEN))
    _store(_at(GEN), g + 1)  # odd: being written
    _store(_at(FN), f)
    _store(_at(ARGS), a)
    _store(_at(DIMS), d)
    _store(_at(STEPS), st)
    _store(_at(DATA), dt)
    _store(_at(NARR), array_count)
    _store(_at(NDIM), inner_ndim)
    _store(_at(TOTAL), total)
    _store(_at(NTHREADS), n_threads)
    _store(_at(DONE), 0)
    g += 2
    _store(_at(NEXT), (g & _MASK32) << 32)
    _add(_at(GEN), 1)  # even: published (sequentially consistent, before SLEEPERS is read)
    if _load(_at(SLEEPERS)) > 0:
        _futex_wake(GEN)
    if probe != 2:
        _run_entries(g, 0)
    pinned = _load(_at(PIN)) != 0
    spins = 0
    done = _load(_at(DONE))
    while done < total:
        if spins < SPIN:
            _pause()
            spins += 1
            if pinned and spins % CHECK == 0:
                _rescue(n_threads)
        elif probe == 2:  # the self-check: after the wait, what the threads left runs here (and shows)
            if _sleep_while(DONE, done, WAITING, _load(_at(PROBE_TS))):
                _run_entries(g, 0)
        else:
            _sleep_while(DONE, done, WAITING)
        done = _load(_at(DONE))
    _store(_at(BUSY), 0)


@cfunc(types.intp(), cache=True)
def _get_thread_id():
    """Numba's get_thread_id: k for pool thread k, 0 for any other (a caller)."""
    tid = _syscall(SYS_GETTID, 0, 0, 0, 0)
    for k in range(1, _load(_at(NWORK)) + 1):
        if _load(_at(TIDS + 8 * k)) == tid:
            return k
    return 0


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
        parallel._launch_threads()  # Numba's layer first, whose symbols ours then replace
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


@njit(parallel=True, cache=True)
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


def _start() -> None:
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
    run = ctypes.CFUNCTYPE(None, ctypes.c_int64)(_worker.address)
    started = []
    for k in range(1, n):
        ready = threading.Event()

        def body(k=k, ready=ready):
            _state[TIDS + 8 * k] = threading.get_native_id()
            if pin:
                try:
                    os.sched_setaffinity(0, {cpus[k]})
                except OSError as e:
                    _pin_failures.append(f"thread {k} to CPU {cpus[k]}: {e.strerror or e}")
            ready.set()
            run(k)  # ctypes lets the GIL go for the thread's whole life

        t = threading.Thread(target=body, name=f"gpt2numba-pool-{k}", daemon=True)
        t.start()
        started.append((t, ready))
    for t, ready in started:
        ready.wait()
        _threads.append(t)
    _state[PIN] = int(pin)
    _state[NWORK] = n - 1


def _stop() -> None:
    """Let the threads return (before the interpreter frees what they read)."""
    _state[NWORK] = 0
    _state[GEN] = -2
    _futex_wake(GEN)
    for t in _threads:
        t.join(timeout=1.0)
    _threads.clear()


def _after_fork() -> None:
    """In a forked child only the forking thread exists. Its regions run on it alone until the first one
    starts the pool's threads (_start_in_region): a child that only execs, such as the one between fork
    and exec of ``subprocess.Popen(preexec_fn=...)``, never starts a thread."""
    global _passes_lock
    if _off:
        return
    _threads.clear()
    _passes.clear()  # (the other threads in passes are not in the child)
    _holder.clear()
    _passes_lock = threading.Lock()  # another thread may have held it at the fork
    start = _state[START]
    _state[:] = 0
    _state[START] = start
    _state[LAZY] = 1
    _pin_failures.clear()


@ctypes.CFUNCTYPE(None)
def _start_in_region() -> None:
    """_start, called from the first parallel region after a fork (ctypes takes the GIL, which the region
    has let go)."""
    try:
        _start()
    except Exception as e:  # the region runs on its caller alone, as before a start
        warnings.warn(f"gpt2numba's pool could not start its threads after a fork ({e!r}); parallel "
                      f"regions run on their caller alone", RuntimeWarning, stacklevel=1)


def describe() -> str:
    """Where this process's parallel regions run, for reports."""
    if not enabled():
        off = f" (gpt2numba's pool is off: {_off[0]})" if _off else ""
        return f"Numba's {numba.threading_layer()} threading layer{off}"
    n = int(_state[NWORK]) + 1
    out = f"gpt2numba's pool of {n} thread{'s' * (n > 1)}"
    if _sized:
        out += f" ({_sized[0]})"
    out += ", pinned one to a CPU" if _cpus else ""
    failed = _pin_failures + ([f"{_state[PIN_FAILS]} in the pool's threads"] if _state[PIN_FAILS] else [])
    if failed:
        out += f"; pinning failed: {'; '.join(failed)}"
    return out


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
        try:
            os.sched_setaffinity(tid if tid != threading.get_native_id() else 0, before)
        except OSError:  # the thread has ended
            pass

"""How a parallel region runs on gpt2numba's threads: the cfuncs that stand in for Numba's
``numba_parallel_for`` and ``get_thread_id``, and the state they share (pool.py starts the threads,
installs the cfuncs and decides who is pinned where).

Every prange in the kernels compiles to a call of the symbol ``numba_parallel_for`` with a
schedule of entries (one per thread, each a run of the prange's iterations) and a gufunc
that runs them. _parallel_for runs each schedule on the pool's threads, the caller among them:

- A job is published under GEN: odd while the caller writes it, even once it may be read.
  Threads claim entries with a compare-and-swap on NEXT, whose high half is the GEN the
  entry belongs to, so a thread that read a job late can never run an entry of the next.
- Waiting spins (``pause``, never a yield), then sleeps on a futex.
- When the threads are pinned (PIN) and a neighbour preempts one in the middle of an entry,
  the caller, once idle, sees that the thread's CPU time has stopped and moves the thread to
  its own CPU; the thread pins itself back once it has run its entries.
- A region started while another runs (another Python thread, or a prange inside a prange)
  runs on its caller alone.
- The first region after a fork starts the threads (LAZY, START); the self-check's region
  records its arguments (PROBE, SEEN).

Which thread runs an entry never changes what the entry computes (chunks.py), so results
are the same bits as under Numba's own layer.
"""

from __future__ import annotations

import os

import numpy as np
from llvmlite import binding as ll, ir
from numba import cfunc, njit, types
from numba.extending import intrinsic

from . import numbacache
from .dispatch import X86

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

SYS_GETTID, SYS_FUTEX, SYS_SCHED_SETAFFINITY, SYS_CLOCK_GETTIME, SYS_GETCPU = 186, 202, 203, 228, 309  # x86-64's
FUTEX_WAIT, FUTEX_WAKE = 128, 129  # the process-private forms
CLOCK_MONOTONIC = 1
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
    """x86's pause, a spinning thread's hint to its core; elsewhere nothing. The cfuncs compile at import
    on every CPU, and another CPU's LLVM aborts the process on an x86 instruction (the pool itself runs
    only on x86-64: pool.enabled)."""
    def codegen(context, builder, sig, args):
        if X86:
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


@njit(nogil=True, cache=True, inline="always", fastmath=False)
def _at(word):
    return _base(0) + 8 * word


@njit(nogil=True, cache=True, fastmath=False)
def _futex_wait(word, expected, timeout):
    """Sleep while ``word`` holds ``expected``, for at most ``timeout`` (the address of a timespec; 0: no limit).
    The result says nothing of why it returned (libc's syscall() gives -1 and errno): callers look again."""
    return _syscall(SYS_FUTEX, _at(word), FUTEX_WAIT, expected & _MASK32, timeout)


@njit(nogil=True, cache=True, fastmath=False)
def _futex_wake(word):
    _syscall(SYS_FUTEX, _at(word), FUTEX_WAKE, 1 << 30, 0)


@njit(nogil=True, cache=True, fastmath=False)
def _sleep_while(word, value, count, timeout=0):
    """Sleep while ``word`` holds ``value`` (at most ``timeout``, see _futex_wait); ``count`` tells the writer
    someone is asleep and needs waking."""
    _add(_at(count), 1)
    if _load(_at(word)) == value:
        _futex_wait(word, value, timeout)
    _add(_at(count), -1)


@njit(nogil=True, cache=True, fastmath=False)
def _pin(tid, k):
    """Pin thread ``tid`` (0: the calling one) to thread k's CPU; a failure is counted in PIN_FAILS."""
    words = _load(_at(MASK_WORDS))
    if _syscall(SYS_SCHED_SETAFFINITY, tid, 8 * words, _base(2) + 8 * words * k, 0) < 0:
        _add(_at(PIN_FAILS), 1)


@njit(nogil=True, cache=True, fastmath=False)
def _clock_ns(clock):
    """The time of ``clock`` (a clockid_t) in ns."""
    ts = np.zeros(2, np.int64)
    _syscall(SYS_CLOCK_GETTIME, clock, ts.ctypes.data, 0, 0)
    return ts[0] * 1_000_000_000 + ts[1]


@njit(nogil=True, cache=True, fastmath=False)
def _cpu_ns(tid):
    """CPU time of thread ``tid`` in ns (its clock, CLOCK_THREAD_CPUTIME of another thread)."""
    return _clock_ns(((~tid) << 3) | 6)


@njit(nogil=True, cache=True, fastmath=False)
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


@njit(nogil=True, cache=True, fastmath=False)
def _pin_back(k):
    """If the caller moved thread k to its CPU (_rescue), pin it back to its own."""
    if _load(_at(MOVED + 8 * k)):
        _store(_at(MOVED + 8 * k), 0)
        _pin(0, k)


@cfunc(types.void(types.int64), cache=True)
def _worker(k):
    """Thread k's life: wait for a job, run its entries, until GEN goes negative. The job out when it
    starts is one it looks at too: a thread that comes late (preempted on a busy machine between its
    start and here) still takes entries of the self-check's job, which waits for the pool's threads."""
    seen = -1
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


@njit(nogil=True, cache=True, fastmath=False)
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


@njit(nogil=True, cache=True, fastmath=False)
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
    spins = deadline = 0
    done = _load(_at(DONE))
    while done < total:
        if spins < SPIN:
            _pause()
            spins += 1
            if pinned and spins % CHECK == 0:
                _rescue(n_threads)
        elif probe == 2:  # the self-check: what the threads leave past its wait runs here (and shows)
            ts = _load(_at(PROBE_TS))
            if deadline == 0:
                deadline = _clock_ns(CLOCK_MONOTONIC) + _load(ts) * 1_000_000_000 + _load(ts + 8)
            if _clock_ns(CLOCK_MONOTONIC) < deadline:
                _sleep_while(DONE, done, WAITING, ts)
            else:
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


numbacache.guard(__name__)  # this module's cached kernels load and save under a lock (numbacache.py)

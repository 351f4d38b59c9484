"""Numba's on-disk cache of our kernels, safe for processes that compile at once.

Numba names a new entry's data file by counting the entries of the function's index
(numba/core/caching.py, IndexDataCacheFile.save: read the index, take the first free `f.N.nbc`, write the
index, then the data). Two processes that compile two signatures of one kernel at once, or one signature for
two CPUs (a test compiled for AVX2 beside the host's), can both take `f.1.nbc`: the index one of them leaves
then names the code the other wrote, and every later process loads code compiled for other arguments or
another CPU, so a warm process gives other bits than the cold one that compiled (or crashes). Here each kernel
reads and writes its index and data files under a lock on the index (flock: shared to load, exclusive to
save), so that an index never names another entry's data.

Only gpt2numba's own kernels are guarded (the process's other Numba functions are their owners'), and where
the lock cannot be taken (a read-only or lock-less file system) Numba's own behaviour is kept.
"""

from __future__ import annotations

import contextlib
import sys

from numba.core.caching import IndexDataCacheFile

try:
    import fcntl
except ImportError:  # (Windows: no flock; Numba's behaviour as it is)
    fcntl = None


class LockedCacheFile(IndexDataCacheFile):
    """IndexDataCacheFile whose load and save each hold a lock on ``<index>.lock``."""

    def save(self, key, data):
        with _locked(self._index_path, exclusive=True):
            super().save(key, data)

    def load(self, key):
        with _locked(self._index_path, exclusive=False):
            return super().load(key)


@contextlib.contextmanager
def _locked(index_path: str, exclusive: bool):
    try:
        lock = open(index_path + ".lock", "a+b") if fcntl is not None else None
    except OSError:
        lock = None
    if lock is None:
        yield
        return
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield  # (closing the file releases the lock)


def guard(package: str) -> int:
    """Lock the cache files of every cached Numba function (@njit and @cfunc with cache=True) defined at the top
    of the modules of ``package`` imported so far; return how many."""
    files = cache_files(package)
    for each in files.values():
        if type(each) is IndexDataCacheFile:
            each.__class__ = LockedCacheFile
    return len(files)


def cache_files(package: str) -> dict:
    """The cache-file object of every cached Numba function at the top of the modules of ``package`` imported so
    far, by its module and name ("gpt2numba.cpu.kernels._gelu")."""
    found = {}
    for name, module in list(sys.modules.items()):
        if module is None or not (name == package or name.startswith(package + ".")):
            continue
        for value in vars(module).values():
            files = getattr(getattr(value, "_cache", None), "_cache_file", None)
            if isinstance(files, IndexDataCacheFile):
                found[f"{name}.{getattr(value, '__name__', '?')}"] = files
    return found

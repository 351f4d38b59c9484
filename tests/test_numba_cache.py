"""Numba's on-disk cache of the kernels, with several processes compiling at once (cpu/numbacache.py).

Numba names a new cache entry's data file by counting the index's entries, so two processes that add two
entries to one function's index at once can take the same file name, and the index then names another
entry's code. Here the window between reading the index and writing it is widened to a second in both
processes, which compile two signatures of one function at the same moment: guarded, every index entry
holds the code of its own signature; unguarded (Numba as it is), they collide.
"""

import os
import pickle
import re
import subprocess
import sys
import time

import pytest

import gpt2numba
from gpt2numba.cpu import numbacache

_MODULE = """
from numba import njit

@njit(cache=True)
def twice_sum(x):
    s = x[0] * 0
    for i in range(x.shape[0]):
        s += 2 * x[i]
    return s
"""

# Compile twice_sum for one dtype at a given moment, with the index read a second before it is written.
_COMPILE = """
import sys, time
import numpy as np
from numba.core import caching
sys.path.insert(0, {folder!r})
import kernel
if {guarded}:  # (numbacache.py alone: the package would compile its own cfuncs into this cache first)
    import importlib.util
    spec = importlib.util.spec_from_file_location("numbacache", {numbacache!r})
    numbacache = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(numbacache)
    numbacache.guard("kernel")
read = caching.IndexDataCacheFile._load_index
def slow_read(self):
    index = read(self)
    time.sleep(1.0)
    return index
caching.IndexDataCacheFile._load_index = slow_read
while time.time() < {start}:
    time.sleep(0.005)
print(kernel.twice_sum(np.arange(5, dtype={dtype!r})))
"""


def _compile_at_once(folder, guarded: bool) -> None:
    """Two processes compile twice_sum for float64 and int64 at the same moment, into folder's cache."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(folder / "cache")}
    start = time.time() + 5  # (after both have imported Numba)
    scripts = [_COMPILE.format(folder=str(folder), guarded=guarded, numbacache=numbacache.__file__, start=start,
                               dtype=dtype) for dtype in ("float64", "int64")]
    runs = [subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True) for script in scripts]
    for run in runs:
        out, err = run.communicate(timeout=240)
        assert run.returncode == 0, err[-2000:]
        assert float(out) == 20, out


def _entries(folder) -> list[tuple[str, str]]:
    """Each entry of the cache's index: (the signature it names, the signature of the code in its data file)."""
    (index,) = (folder / "cache").rglob("kernel.twice_sum-*.nbi")
    with open(index, "rb") as f:
        pickle.load(f)  # Numba's version
        _, overloads = pickle.loads(f.read())
    sys.path.insert(0, str(folder))  # (the data files pickle the module's functions by name)
    try:
        found = []
        for key, name in overloads.items():
            data = pickle.loads((index.parent / name).read_bytes())
            signature = next(item for item in data if hasattr(item, "return_type"))
            found.append((str(key[0]), str(signature.args)))
        return found
    finally:
        sys.path.remove(str(folder))


def test_two_processes_compiling_two_signatures_at_once_keep_each_ones_code(tmp_path):
    (tmp_path / "kernel.py").write_text(_MODULE)
    _compile_at_once(tmp_path, guarded=True)
    entries = _entries(tmp_path)
    assert len(entries) == 2, entries  # neither entry lost
    assert all(named == held for named, held in entries), entries  # each names its own code


def test_every_kernel_of_the_package_is_guarded():
    """Every cached @njit and @cfunc of gpt2numba loads and saves under the lock, whichever module holds it and
    whenever it is imported (the package imports its modules on first use: each guards its own)."""
    import importlib
    from pathlib import Path

    package = Path(gpt2numba.__file__).parent
    holding = [".".join(("gpt2numba", *path.relative_to(package).with_suffix("").parts))
               for path in sorted(package.rglob("*.py")) if re.search(r"@(njit|cfunc)\(.*cache=True", path.read_text())]
    assert len(holding) > 10, holding
    for module in holding:
        importlib.import_module(module)
    kinds = {name: type(files).__name__ for name, files in numbacache.cache_files("gpt2numba").items()}
    assert len(kinds) > 50, kinds
    assert set(holding) - {"gpt2numba.cpu.numbacache"} <= {name.rsplit(".", 1)[0] for name in kinds}
    assert set(kinds.values()) == {"LockedCacheFile"}, {k: v for k, v in kinds.items() if v != "LockedCacheFile"}

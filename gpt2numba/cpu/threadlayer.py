"""Numba's threading layer: one that coexists with the OpenMP runtimes of torch and others, never OpenMP itself.

Numba's default order is TBB, then OpenMP, then workqueue. Two things make that order costly beside torch:
the ``tbb`` wheel puts ``libtbb.so.12`` in ``<environment>/lib``, which the loader does not search in a
virtual environment, so Numba falls through to the system's GNU OpenMP; and a second GNU OpenMP runtime in a
process that holds torch's makes torch several times slower (pytorch/pytorch#98836; docs/performance.md,
"Beside torch"). So launch() loads TBB from the tbb wheel's own files (from the loader's path where the
wheel is absent), and takes workqueue where TBB is missing or Numba refuses it. A layer the user chooses
($NUMBA_THREADING_LAYER or $NUMBA_THREADING_LAYER_PRIORITY, or numba.config before gpt2numba is imported)
is Numba's to honour, OpenMP included.

launch() changes nothing the process owns: it puts Numba's config back as it found it, writes no variable
to ``os.environ`` and starts no OpenMP runtime. On x86-64 Linux the regions run on gpt2numba's pool (pool.py)
and the layer launched here only holds Numba's thread-count calls; elsewhere it runs the regions.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import threading
from importlib import metadata
from pathlib import Path

import numba

# the file name Numba's _check_tbb_version_compatible asks the loader for, per system
TBB_LIBRARY = {"linux": "libtbb.so.12", "darwin": "libtbb.12.dylib", "win32": "tbb12.dll"}
_tbb: list = []  # the loaded library (kept: the loader would keep it anyway)
_why: list[str] = []  # how the layer was chosen, for describe()
_turns = threading.RLock()  # one pass at a time where the regions run on workqueue


def launch() -> None:
    """Launch Numba's threading layer, if nothing has yet: the one the user chose, else TBB where it loads
    and Numba takes it, else workqueue."""
    from numba.np.ufunc import parallel

    if parallel._is_initialized:
        _why[:] = ["launched before gpt2numba was imported"]
        return
    named = str(numba.config.THREADING_LAYER).lower()
    if named != "default" or os.environ.get("NUMBA_THREADING_LAYER_PRIORITY"):
        _why[:] = [f"chosen by the user ({named if named != 'default' else '$NUMBA_THREADING_LAYER_PRIORITY'})"]
        if named not in ("omp", "workqueue"):  # a choice that may be TBB: the wheel's, which the loader cannot find
            load_tbb()
        parallel._launch_threads()
        return
    found = load_tbb()
    for chosen in ("tbb", "workqueue") if found else ("workqueue",):
        numba.config.THREADING_LAYER = chosen  # (Numba's own config, put back at once: only the launch reads it)
        try:
            parallel._launch_threads()
        except ValueError as e:  # "No threading layer could be loaded": a TBB Numba refuses (older than 2021.6)
            _why[:] = [f"Numba refused TBB from {found}: {str(e).splitlines()[0]}"]
            continue
        finally:
            numba.config.THREADING_LAYER = named
        if chosen == "tbb":
            _why[:] = [f"TBB from {found}"]
        elif not _why:
            _why[:] = ["TBB is not installed here, and OpenMP would not coexist"]
        return


def load_tbb() -> str | None:
    """Load the TBB runtime Numba's TBB layer links to: the ``tbb`` distribution's own file (the dependency
    gpt2numba declares), else one on the loader's path; where from, or None when neither has it."""
    name = TBB_LIBRARY.get(sys.platform)
    if name is None:
        return None
    try:
        dist = metadata.distribution("tbb")
        files = dist.files or []
    except metadata.PackageNotFoundError:
        files = []
    for file in files:
        if file.name == name:
            path = Path(dist.locate_file(file)).resolve()
            try:
                _tbb[:] = [ctypes.CDLL(str(path))]  # by its soname, Numba's tbbpool then finds this copy
                return f"the tbb package ({path})"
            except OSError:
                break
    try:
        _tbb[:] = [ctypes.CDLL(name)]
        return "the loader's path"
    except OSError:
        return None


def turns(regions_here: bool):
    """A pass's turn: where the regions run on this layer (``regions_here``: the pool is off) and it is
    workqueue, which aborts the process on regions from two threads at once, one pass at a time."""
    if regions_here and numba.threading_layer() == "workqueue":
        return _turns
    return contextlib.nullcontext()


def describe() -> str:
    """Numba's layer and why it is that one."""
    from numba.np.ufunc import parallel

    if not parallel._is_initialized:
        return "Numba's threading layer is not launched yet"
    return f"Numba's {numba.threading_layer()} threading layer ({'; '.join(_why) or 'launched by Numba'})"

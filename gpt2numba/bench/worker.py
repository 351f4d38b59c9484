"""A benchmark system's worker process: it builds the system, then runs the parent's calls until told to stop.

core.Remote starts it as ``python -c BOOT worker.py SPEC FD``: SPEC names the function that builds the
system, FD is the worker's end of a multiprocessing pipe. This file imports nothing of gpt2numba, and a
peer's SPEC is a file path (bench/peers/), loaded by its path, so a peer's worker is a process that never
imports gpt2numba: the peer runs as its users run it (gpt2numba's own worker imports gpt2numba by name).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import time
from pathlib import Path

import numpy as np

BOOT = "import runpy, sys; sys.argv.pop(0); runpy.run_path(sys.argv[0], run_name='__main__')"
# what a process's thread settings are made of, as a peer's worker reports them
THREAD_VARIABLES = ("OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "NUMBA_", "GPT2NUMBA_", "LD_PRELOAD")
STARTED_WITH = dict(os.environ)  # this process's environment, before the system's libraries were imported


def load(spec: str):
    """The function ``spec`` names: "package.module:function", or "/path/to/file.py:function" (loaded by path,
    under a name of its own, so that a file named like its library does not hide it)."""
    where, _, name = spec.rpartition(":")
    if where.endswith(".py"):
        module_spec = importlib.util.spec_from_file_location(f"_bench_peer_{Path(where).stem}", where)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_spec.name] = module
        module_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    return getattr(module, name)


def serve(conn, make) -> None:
    """Build the system from the first message's (kind, model_dir, threads), answer (name, version), then
    run calls until the parent sends None."""
    kind, model_dir, threads = conn.recv()
    system, name, version = make(kind, model_dir, threads)
    conn.send((name, version))
    while (msg := conn.recv()) is not None:
        method, arg, want_logits = msg
        try:
            t = time.perf_counter()
            own = getattr(system, method, None)  # a system's own method, else the one every system shares
            out = own(arg) if own else SHARED[method](system, arg)
            seconds = time.perf_counter() - t
            greedy = out.argmax(-1).tolist() if isinstance(out, np.ndarray) else out
            conn.send((seconds, greedy, out if want_logits else None))
        except Exception as e:  # reported to the parent, which stops the run
            conn.send(f"{type(e).__name__}: {e}")


def decode_run(system, job):
    """``n`` greedy decode steps back to back from ``token``, through system.decode: each step's seconds
    and its token. job: (token, n)."""
    token, n = job
    seconds, tokens = [], []
    for _ in range(n):
        t = time.perf_counter()
        token = int(system.decode(token).argmax())
        seconds.append(time.perf_counter() - t)
        tokens.append(token)
    return seconds, tokens


def decode_steps(system, job):
    """Prefill ``ids``, then ``steps`` greedy decode steps, through system.prefill and system.decode (each
    returning (vocab,) logits): seconds per step, the prefill untimed. job: (ids, steps)."""
    ids, steps = job
    seconds, _ = decode_run(system, (int(system.prefill(ids).argmax()), steps))
    return sum(seconds) / steps


def environment(system, arg) -> dict:
    """What the worker ran with: the system's own thread count (its ``threads()``), the thread settings in the
    environment it started with, and whether gpt2numba or Numba were imported in it."""
    threads = getattr(system, "threads", None)
    return {"threads": threads() if threads else None,
            "variables": {k: v for k, v in STARTED_WITH.items() if k.startswith(THREAD_VARIABLES)},
            "imported": sorted(name for name in ("gpt2numba", "numba") if name in sys.modules)}


SHARED = {"decode_run": decode_run, "decode_steps": decode_steps, "environment": environment}

if __name__ == "__main__":
    from multiprocessing.connection import Connection

    serve(Connection(int(sys.argv[2])), load(sys.argv[1]))
